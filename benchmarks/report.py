"""Regenerate the CPU rows of BENCHMARKS.md's table of current figures from the benchmarks in this folder.

    python -m benchmarks.report --list                                 # the rows, their commands; what is kept
    python -m benchmarks.report --only adam-torch,adam-deepspeed --quick   # a smoke run at reduced sizes
    python -m benchmarks.report                                        # every CPU row: hours on a 2-core machine
    python -m benchmarks.report --only ckpt-save,ckpt-load --write     # and rewrite those rows in BENCHMARKS.md

Each row of the registry (`benchmarks.report_rows`) runs its benchmark's command (rows that share a command share
one run), reads our figure, the peer's and the ratio from the result, and is stamped with this machine (CPU model
and ISA from /proc/cpuinfo, core count, torch's version) and today's date. The rows are printed as markdown; with
``--write`` they replace the rows of the same name between ``<!-- report:begin -->`` and ``<!-- report:end -->``
and nothing else changes. GPU rows, predictions and the CPU runs the registry does not hold (long or manual ones)
are never regenerated: they stay as measured. ``--quick`` passes reduced sizes and rounds, for checking that the
rows still work, not for figures to keep. Exit status 1 if a selected row could not be produced.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):          # run by path: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report_rows import BY_NAME, ROWS  # noqa: E402
from benchmarks.report_run import machine, run_command, today  # noqa: E402
from benchmarks.report_table import HEADER, RULE, format_row, replace_rows, table_names  # noqa: E402
from benchmarks.report_types import ROOT, Command, Row  # noqa: E402

Runner = Callable[[Command, Path, bool], Any]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the rows and their commands, run nothing")
    ap.add_argument("--only", default=None, help="comma-separated row names (default: every CPU row)")
    ap.add_argument("--quick", action="store_true", help="reduced sizes and rounds: a smoke run")
    ap.add_argument("--write", action="store_true", help="rewrite these rows in the document")
    ap.add_argument("--doc", type=Path, default=ROOT / "BENCHMARKS.md", help="the document (default BENCHMARKS.md)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the benchmarks' JSON results in this folder")
    return ap.parse_args(argv)


def select(only: str | None) -> list[Row]:
    """The rows ``--only`` names, in the registry's order (all of them without it); SystemExit on an unknown name."""
    if only is None:
        return list(ROWS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; `--list` names them")
    return [row for row in ROWS if row.name in names]


def listing(doc: Path) -> str:
    """Every row of the registry with its command, then the table's rows the report keeps as they are."""
    lines = ["regenerated (CPU rows, in the order they run):"]
    lines += [f"  {row.name:<24} {row.command.text()}" for row in ROWS]
    try:
        names = table_names(doc.read_text())
    except (OSError, ValueError) as exc:
        return "\n".join(lines + [f"no table in {doc}: {exc}"])
    kept = [n for n in names if n not in BY_NAME]
    if kept or names:
        gpu = [n for n in kept if n.startswith("gpu-")]
        lines.append(f"kept as they are in {doc.name}, not regenerated: GPU rows ({', '.join(gpu) or 'none'}); "
                     f"other rows ({', '.join(n for n in kept if n not in gpu) or 'none'})")
    return "\n".join(lines)


def produce(rows: list[Row], runner: Runner, workdir: Path, quick: bool) -> tuple[dict[str, str], dict[str, str]]:
    """({name: table line} of the rows produced, {name: why not} of the others); each command runs once."""
    results: dict[Command, Any] = {}
    errors: dict[Command, str] = {}
    lines, failed = {}, {}
    stamp, date = machine() + (" (--quick)" if quick else ""), today()
    for row in rows:
        if row.command not in results and row.command not in errors:
            try:
                results[row.command] = runner(row.command, workdir, quick)
            except Exception as exc:  # noqa: BLE001 - a failed benchmark: report it, go on with the others
                errors[row.command] = f"{type(exc).__name__}: {exc}"
        if row.command in errors:
            failed[row.name] = errors[row.command]
            continue
        try:
            figures = row.extract(results[row.command])
        except Exception as exc:  # noqa: BLE001 - a peer missing from the result, a failed configuration
            failed[row.name] = f"{type(exc).__name__}: {exc}"
            continue
        lines[row.name] = format_row(row.name, row.what, figures, row.command.text(), stamp, date)
    return lines, failed


def main(argv: list[str] | None = None, runner: Runner = run_command) -> int:
    args = parse_args(argv)
    if args.list:
        print(listing(args.doc))
        return 0
    if args.write and args.quick:
        raise SystemExit("--quick figures are a smoke run: they are not written into the document")
    rows = select(args.only)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        lines, failed = produce(rows, runner, args.keep, args.quick)
    else:
        with tempfile.TemporaryDirectory(prefix="zo-report-") as tmp:
            lines, failed = produce(rows, runner, Path(tmp), args.quick)
    print("\n".join([HEADER, RULE, *lines.values()]))
    for name, why in failed.items():
        print(f"{name}: not produced: {why}", file=sys.stderr)
    print("GPU rows, predictions and long or manual CPU runs are not regenerated: they stay as measured.",
          file=sys.stderr)
    if args.write and lines:
        text = args.doc.read_bytes().decode("utf-8")
        args.doc.write_bytes(replace_rows(text, lines, [row.name for row in ROWS]).encode("utf-8"))
        print(f"wrote {len(lines)} row(s) into {args.doc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
