"""zero-offload's DeepSpeed stand-in: in a process started with ``ZERO_OFFLOAD_AS_DEEPSPEED=1``, ``import deepspeed``
(every submodule, ``importlib.util.find_spec`` and ``importlib.metadata``) answers with ``zero_offload.deepspeed``.

The mechanism is coverage.py's ``COVERAGE_PROCESS_START``: a ``.pth`` file that the install puts in site-packages
(``zero_offload_stand_in.pth``) runs one line at every interpreter start, and that line calls `install` only where
the variable is set. Without it nothing changes: an installed DeepSpeed stays itself. This module is a top-level
one and imports only the standard library, so the hook costs microseconds; ``zero_offload`` (and torch) load when
the program first imports ``deepspeed``.

``deepspeed.X.Y`` is ``zero_offload.deepspeed.X.Y``: the same module object under both names (their state is
one), its ``__file__`` inside the ``zero_offload`` package. ``importlib.metadata`` finds a ``deepspeed``
distribution whose version is `deepspeed_version`: the DeepSpeed release whose behaviour is mirrored, with a
local label naming zero-offload's version (``0.19.8+zo0.1.0``), which every version comparison treats as
0.19.8.

``python -m zero_offload_stand_in rank [--module] [--no_python] [--no_local_rank] SCRIPT ARGS...`` is the command
each rank of ``zero-offload run deepspeed ...`` runs under torch's elastic launcher: it becomes the training
command as DeepSpeed's ``launch.py`` builds it, ``--local_rank=N`` before the script's own arguments.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys

__all__ = ["ENV", "MIRRORED_VERSION", "enabled", "install", "install_if_enabled", "installed", "deepspeed_version",
           "rank_command"]

ENV = "ZERO_OFFLOAD_AS_DEEPSPEED"
MIRRORED_VERSION = "0.19.8"          # the DeepSpeed release whose behaviour zero-offload's face mirrors
_NAME, _TARGET = "deepspeed", "zero_offload.deepspeed"


def enabled(environ=None) -> bool:
    """Whether ``environ`` (default ``os.environ``) asks for the stand-in: the variable set, and not to 0."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return value.strip() not in ("", "0", "false", "False")


def deepspeed_version() -> str:
    """``0.19.8+zo<zero-offload's version>``: what ``deepspeed.__version__`` and ``importlib.metadata`` say."""
    try:
        ours = importlib.metadata.version("zero-offload")
    except importlib.metadata.PackageNotFoundError:     # a source tree on PYTHONPATH, never installed
        ours = "0"
    return f"{MIRRORED_VERSION}+zo{re.sub(r'[^0-9A-Za-z.]', '.', ours)}"


def _package_dir() -> str | None:
    """zero_offload's folder, found without importing it (finding a top-level package imports nothing)."""
    spec = importlib.util.find_spec("zero_offload")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the module ``zero_offload.deepspeed.X`` itself: one object, two names."""

    def __init__(self, target: str):
        self.target = target
        self.own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # importlib set __spec__ to the alias's; the module keeps its own (its name, reload, pickling of it).
        module.__spec__ = self.own_spec


class _Distribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution ``importlib.metadata`` reports under the stand-in."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {deepspeed_version()}\n"
                    f"Summary: zero-offload standing in for DeepSpeed {MIRRORED_VERSION}\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path):
        import pathlib
        return pathlib.Path(_package_dir() or ".") / "deepspeed" / path


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: ``deepspeed`` and its submodules, and the ``deepspeed`` distribution."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        if fullname == _NAME:          # answered without importing zero_offload (and torch): find_spec is cheap
            base = _package_dir()
            if base is None:
                return None
            folder = os.path.join(base, "deepspeed")
            spec = importlib.machinery.ModuleSpec(_NAME, _AliasLoader(_TARGET),
                                                  origin=os.path.join(folder, "__init__.py"), is_package=True)
            spec.submodule_search_locations = [folder]
            spec.has_location = True
            return spec
        own_name = _TARGET + fullname[len(_NAME):]
        try:
            own = importlib.util.find_spec(own_name)
        except ModuleNotFoundError:    # a parent that is not a package
            return None
        if own is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(own_name), origin=own.origin,
                                              is_package=own.submodule_search_locations is not None)
        if own.submodule_search_locations is not None:
            spec.submodule_search_locations = list(own.submodule_search_locations)
        spec.has_location = own.has_location
        return spec

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or re.sub(r"[-_.]+", "_", name).lower() == _NAME:
            return iter([_Distribution()])
        return iter([])


_FINDER = _Finder()


def installed() -> bool:
    """Whether this process answers ``import deepspeed`` with zero-offload's face."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Put the stand-in first on ``sys.meta_path`` (idempotent). Called by the ``.pth`` hook where `enabled`.

    A DeepSpeed module imported before this call stays in ``sys.modules`` and is dropped, so the next import
    of any ``deepspeed`` name gets the face (only code that kept a reference still holds the old module)."""
    if installed():
        return
    for name in [m for m in sys.modules if m == _NAME or m.startswith(_NAME + ".")]:
        if not getattr(sys.modules[name], "__name__", "").startswith(_TARGET):
            del sys.modules[name]
    sys.meta_path.insert(0, _FINDER)


def install_if_enabled() -> None:
    """The ``.pth`` hook's call: `install` where ``ZERO_OFFLOAD_AS_DEEPSPEED`` asks for it (`enabled`)."""
    if enabled():
        install()


def rank_command(argv: list[str], local_rank: int) -> list[str]:
    """One rank's command, as DeepSpeed 0.19.8's ``launcher/launch.py`` builds it: ``python -u [-m] SCRIPT
    --local_rank=N ARGS``; ``--no_python`` runs SCRIPT as the program, ``--no_local_rank`` leaves the flag out.

    ``argv``: ``[--module] [--no_python] [--no_local_rank] SCRIPT ARGS...``.

    Raises:
        ValueError: no SCRIPT.
    """
    flags = set()
    while argv and argv[0] in ("--module", "--no_python", "--no_local_rank"):
        flags.add(argv[0])
        argv = argv[1:]
    if not argv:
        raise ValueError("zero_offload_stand_in rank: no training script given")
    cmd = [] if "--no_python" in flags else [sys.executable, "-u"] + (["-m"] if "--module" in flags else [])
    cmd.append(argv[0])
    if "--no_local_rank" not in flags:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + argv[1:]


if __name__ == "__main__":        # one rank of `zero-offload run deepspeed ...`, started by torch's elastic launcher
    if sys.argv[1:2] != ["rank"]:
        sys.exit("usage: python -m zero_offload_stand_in rank [--module] [--no_python] [--no_local_rank] SCRIPT ...")
    command = rank_command(sys.argv[2:], int(os.environ.get("LOCAL_RANK", "0")))
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))   # DeepSpeed's launch.py sets it
    os.execvp(command[0], command)
