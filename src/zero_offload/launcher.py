"""`zero-offload run [--] CMD ARGS...`: run a DeepSpeed codebase unchanged, zero-offload standing in for DeepSpeed.

CMD runs with ``ZERO_OFFLOAD_AS_DEEPSPEED=1`` in its environment, so every Python process it starts (``python
train.py``, ``torchrun``, ``accelerate launch``, a shell script's) answers ``import deepspeed`` with
``zero_offload.deepspeed`` (`zero_offload_stand_in`, through the ``.pth`` start-up hook the install puts in
site-packages).

``zero-offload run deepspeed [launcher flags] train.py ARGS`` is DeepSpeed 0.19.8's launcher, single node, with
no DeepSpeed installed: it takes ``--num_gpus``/``--num_accelerators``, ``--num_nodes 1``,
``--include``/``--exclude localhost:...``, ``--master_addr``, ``--master_port``, ``--module``, ``--no_python`` and
``--no_local_rank``, exports ``.deepspeed_env`` files as DeepSpeed does, and starts the ranks through torch's
elastic launcher (``python -m torch.distributed.run``), each passed ``--local_rank=N`` before the script's
arguments as DeepSpeed's ``launch.py`` does. A hostfile with more than one host, or ``--num_nodes`` > 1, is
refused with the torchrun command that replaces it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import zero_offload_stand_in as stand_in

__all__ = ["run", "launch_deepspeed", "deepspeed_launch_command", "LaunchError", "hook_installed"]

DEFAULT_HOSTFILE = "/job/hostfile"         # DeepSpeed's default (DLTS_HOSTFILE)
LOCAL_NAMES = ("localhost", "127.0.0.1")


class LaunchError(ValueError):
    """A launch that cannot be done: the message names the flag, file or value at fault and what to run."""


def hook_installed() -> bool:
    """Whether the ``.pth`` start-up hook sits in a site-packages folder of this interpreter (so child Python
    processes install the stand-in)."""
    import site
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return any((Path(f) / "zero_offload_stand_in.pth").is_file() for f in folders)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zero-offload run deepspeed", allow_abbrev=False,
                                description="DeepSpeed's launcher, single node, over torch's elastic launcher")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE)
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1)
    p.add_argument("--launcher", default="pdsh")
    p.add_argument("--launcher_args", default="")
    for flag in ("--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check", "--force_multi",
                 "--save_pid", "--bind_cores_to_rank"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None)
    p.add_argument("--log_level", default=None)
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _hosts(hostfile: str) -> dict[str, int]:
    """{host: slots} of an MPI-style hostfile (``worker-0 slots=4``), {} when there is none.

    Raises:
        LaunchError: a line that is not ``HOST slots=N``.
    """
    path = Path(hostfile)
    if not path.is_file():
        return {}
    hosts: dict[str, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise LaunchError(f"hostfile '{hostfile}' line {number}: {line!r} is not 'HOST slots=N'")
        hosts[parts[0]] = int(parts[1][6:])
    return hosts


def _local_slots() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _filter(slots: list[int], include: str, exclude: str) -> list[int]:
    """DeepSpeed's ``NODE[:SLOT,...][@NODE...]`` filter, on this node only.

    Raises:
        LaunchError: both given, another host named, or a slot this node does not have.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive (as in DeepSpeed)")
    spec = include or exclude
    if not spec:
        return slots
    chosen: list[int] = []
    for node in spec.split("@"):
        host, _, listed = node.partition(":")
        if host not in LOCAL_NAMES:
            raise LaunchError(f"--{'include' if include else 'exclude'} {spec!r} names host {host!r}; the "
                              f"stand-in's launcher is single node (use localhost)")
        picked = [int(s) for s in listed.split(",")] if listed else list(slots)
        missing = [s for s in picked if s not in slots]
        if missing:
            raise LaunchError(f"--{'include' if include else 'exclude'} {spec!r}: slot(s) {missing} not on this node "
                              f"(it has {slots})")
        chosen += picked
    return [s for s in slots if s in chosen] if include else [s for s in slots if s not in chosen]


def _torchrun_hint(hosts: dict[str, int], args) -> str:
    first = next(iter(hosts), "MASTER_HOST")
    slots = max(hosts.values(), default=1)
    script = " ".join([args.user_script, *args.user_args])
    return (f"on each of the {len(hosts) or args.num_nodes} nodes run: zero-offload run -- torchrun "
            f"--nnodes {len(hosts) or args.num_nodes} --node_rank <this node's index> --nproc_per_node {slots} "
            f"--master_addr {first} --master_port {args.master_port} {script} "
            f"(the script reads its rank from LOCAL_RANK; add --local_rank=$LOCAL_RANK where it needs the flag)")


def _deepspeed_env() -> dict[str, str]:
    """KEY=VALUE lines of ``~/.deepspeed_env`` and ``./.deepspeed_env`` (``DS_ENV_FILE``), as DeepSpeed exports
    them to every rank."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    out: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), "."):
        path = Path(folder) / name
        if path.is_file():
            for line in path.read_text().splitlines():
                key, sep, value = line.strip().partition("=")
                if sep and key:
                    out[key] = value
    return out


def deepspeed_launch_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the command, the variables to add) that start ``deepspeed [flags] SCRIPT ARGS`` on this node.

    Raises:
        LaunchError: a multi-node hostfile or ``--num_nodes`` > 1 (with the torchrun command to run instead),
            a filter naming another host or a missing slot, a filter with ``--num_gpus``/``--num_nodes``, or a
            flag whose feature is not built (``--autotuning``).
    """
    args = _parser().parse_args(argv)
    hosts = _hosts(args.hostfile)
    remote = [h for h in hosts if h not in LOCAL_NAMES]
    if len(hosts) > 1 or remote and not (args.include or args.exclude) or args.num_nodes > 1 or args.force_multi:
        where = f"hostfile '{args.hostfile}' lists {len(hosts)} host(s) ({', '.join(hosts)})" if hosts else \
            f"--num_nodes {args.num_nodes}"
        raise LaunchError(f"zero-offload run deepspeed: {where}; multi-node launch is not built into the stand-in. "
                          + _torchrun_hint(hosts, args))
    if args.autotuning:
        raise LaunchError("zero-offload run deepspeed --autotuning: DeepSpeed's autotuner is not built; "
                          "`zero-offload estimate` plans the config instead")
    if (args.include or args.exclude) and (args.num_nodes >= 0 or args.num_gpus >= 0):
        raise LaunchError("--num_nodes/--num_gpus cannot be given with --include/--exclude (as in DeepSpeed)")
    slots = list(range(next(iter(hosts.values())) if hosts else _local_slots()))
    slots = _filter(slots, args.include, args.exclude)
    if args.num_gpus > 0:      # DeepSpeed takes the first N slots without checking them (N CPU ranks on a CPU box)
        slots = list(range(args.num_gpus))
    if not slots:
        raise LaunchError("zero-offload run deepspeed: no slot left to launch on (check --include/--exclude)")
    env = {**_deepspeed_env(), stand_in.ENV: "1"}
    if _local_slots() > 1 or args.include or args.exclude:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    flags = [f for f, on in (("--module", args.module), ("--no_python", args.no_python),
                             ("--no_local_rank", args.no_local_rank)) if on]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={len(slots)}",
           f"--master_addr={args.master_addr or '127.0.0.1'}", f"--master_port={args.master_port}",
           "--module", "zero_offload_stand_in", "rank", *flags, args.user_script, *args.user_args]
    return cmd, env


def launch_deepspeed(argv: list[str]) -> int:
    """Run ``deepspeed [flags] SCRIPT ARGS`` on this node (`deepspeed_launch_command`); returns its exit code."""
    cmd, env = deepspeed_launch_command(argv)
    return subprocess.call(cmd, env={**os.environ, **env})


def run(argv: list[str]) -> int:
    """``zero-offload run [--] CMD ARGS``: CMD with the stand-in in every Python process; returns its exit code.

    Raises:
        LaunchError: no CMD, the start-up hook missing from site-packages (reinstall), or as `launch_deepspeed`.
    """
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise LaunchError("zero-offload run: give the command to run, e.g. zero-offload run -- python train.py")
    if not hook_installed():
        raise LaunchError("zero-offload run: the start-up hook zero_offload_stand_in.pth is not in this "
                          "interpreter's site-packages; reinstall zero-offload (pip install . or pip install -e .)")
    if os.path.basename(argv[0]) == "deepspeed":
        return launch_deepspeed(argv[1:])
    try:
        return subprocess.call(argv, env={**os.environ, stand_in.ENV: "1"})
    except FileNotFoundError:
        raise LaunchError(f"zero-offload run: command {argv[0]!r} not found") from None
