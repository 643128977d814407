"""What a row of BENCHMARKS.md's table of current figures is made of: the benchmark command that measures it, the
function that reads our figure, the peer's and their ratio out of that command's JSON result, and the figures.

A `Command` is written as a user types it (``python`` stands for the interpreter that runs the report); the report
appends the option that names the JSON file (``json_flag``), then, under ``--quick``, the reduced sizes (``quick``:
argparse keeps an option's last value, so they override the full ones).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


class RowError(ValueError):
    """A benchmark result that lacks what a row reads (a peer missing, a failed configuration)."""


@dataclass(frozen=True)
class Command:
    """One benchmark run. ``argv``: the command as typed, from the repository root; ``quick``: arguments appended by
    ``--quick``; ``json_flag``: the option that takes the path of the JSON result (None: the result is the command's
    stdout, read by the row's extractor); ``env``: variables the command needs (``DS_ACCELERATOR=cpu``)."""

    argv: tuple[str, ...]
    quick: tuple[str, ...] = ()
    json_flag: str | None = "--json"
    env: tuple[tuple[str, str], ...] = ()

    def text(self) -> str:
        """The command as a user types it (without the JSON option): what the table's command column shows."""
        prefix = [f"{k}={v}" for k, v in self.env]
        return " ".join(prefix + [shlex.quote(a) for a in self.argv])

    def script(self) -> Path:
        """The Python file the command runs: ``python FILE ...`` or ``python -m MODULE ...`` (a module of ``src``)."""
        if self.argv[1] == "-m":
            return ROOT / "src" / Path(*self.argv[2].split(".")).with_suffix(".py")
        return ROOT / self.argv[1]

    def arguments(self) -> tuple[str, ...]:
        """The arguments after the script or module name."""
        return self.argv[3:] if self.argv[1] == "-m" else self.argv[2:]


@dataclass(frozen=True)
class Figures:
    """A row's three figure cells, as printed: ours, the peer's (named), and the ratio (ours / peer of the figures
    shown, unless the cell says it is paired by round or step)."""

    ours: str
    peer: str
    ratio: str


@dataclass(frozen=True)
class Row:
    """A row the report regenerates: ``name`` (the table's first cell and ``--only``'s key), ``what`` is measured,
    the ``command`` that measures it (rows may share one), and ``extract``, which turns the command's result (parsed
    JSON, or ``{"stdout": text}`` when the command has no JSON option) into `Figures`, raising `RowError` or
    `KeyError` when the result lacks them."""

    name: str
    what: str
    command: Command
    extract: Callable[[Any], Figures]
