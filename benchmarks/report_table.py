"""BENCHMARKS.md's table of current figures as text: its header, one row as a markdown line, and rows replaced
between the two marker comments with every other byte of the document kept.

A row's first cell is its name in backticks (`` `adam-torch` ``); a regenerated row replaces the line of the same
name, a new one goes after the rows of the registry that precede it, and every other line (GPU rows, predictions,
long CPU runs kept as measured) stays as it is.
"""
from __future__ import annotations

from typing import Sequence

from benchmarks.report_types import Figures

BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
COLUMNS = ("row", "what is measured", "ours", "peer", "ratio", "command", "machine", "date")
HEADER = "| " + " | ".join(COLUMNS) + " |"
RULE = "|" + "---|" * len(COLUMNS)


def format_row(name: str, what: str, figures: Figures, command: str, machine: str, date: str) -> str:
    """One table line; ``|`` inside a cell is escaped so that the cell stays one cell."""
    cells = [f"`{name}`", what, figures.ours, figures.peer, figures.ratio, f"`{command}`", machine, date]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def row_name(line: str) -> str | None:
    """The name in a table line's first cell (`` | `name` | ... ``), or None for any other line."""
    cells = line.strip().split("|")
    if len(cells) < 3 or cells[0] != "":
        return None
    first = cells[1].strip()
    if len(first) > 2 and first[0] == first[-1] == "`":
        return first[1:-1]
    return None


def split_markers(text: str) -> tuple[str, list[str], str]:
    """(text up to and including the begin marker's line, the lines between the markers with their line endings,
    text from the end marker's line on). Raises ValueError unless each marker is there once, begin first."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"expected one {BEGIN} line, then one {END} line")
    b, e = begins[0], ends[0]
    return "".join(lines[:b + 1]), lines[b + 1:e], "".join(lines[e:])


def table_names(text: str) -> list[str]:
    """The names of the rows between the markers, in order."""
    return [n for n in map(row_name, split_markers(text)[1]) if n is not None]


def replace_rows(text: str, fresh: dict[str, str], order: Sequence[str]) -> str:
    """``text`` with each line between the markers whose row is in ``fresh`` replaced by ``fresh[name]`` (a line
    without its ending). A name not in the table yet is inserted after the last table row that comes before it in
    ``order`` (the registry's order), else after the header. Everything else is kept byte for byte."""
    head, lines, tail = split_markers(text)
    newline = "\r\n" if any(line.endswith("\r\n") for line in lines) else "\n"
    out = [fresh[row_name(line)] + newline if row_name(line) in fresh else line for line in lines]
    for name in order:
        if name not in fresh or name in map(row_name, out):
            continue
        earlier = set(order[:order.index(name)])
        at = max((i + 1 for i, line in enumerate(out) if row_name(line) in earlier), default=None)
        if at is None:
            at = next((i + 1 for i, line in enumerate(out) if line.startswith("|---")), len(out))
        out.insert(at, fresh[name] + newline)
    return head + "".join(out) + tail
