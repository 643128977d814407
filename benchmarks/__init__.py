"""The benchmark scripts, importable as a package from the repository root (``python -m benchmarks.report``).

Each script also runs by path (``python benchmarks/bench_engine.py``) and imports its siblings as top-level modules
(``from json_result import emit``); the package adds nothing to them.
"""
