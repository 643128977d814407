"""Resolve ``deepspeed.*`` names as code uses them, under the stand-in: the census of nine codebases
(tests/data/deepspeed_api_census.tsv, a copy of shared/'s) and the names the installed libraries reference.

Run as a script inside a process with the stand-in on (``ZERO_OFFLOAD_AS_DEEPSPEED=1``): it prints one JSON object
{name: "provided" | "not built" | "missing: why"} for the names given on stdin, one per line.
"""
from __future__ import annotations

import ast
import importlib
import json
import re
import sys
from pathlib import Path

# Outside the scope (tensor, pipeline and expert parallelism, compression) and the features that need them
# (inference, sequence parallelism: its own issue). Census names under these are counted apart.
EXCLUDED = re.compile(r"^deepspeed\.(pipe|PipelineEngine|runtime\.pipe|moe|module_inject|tp_model_init|"
                      r"runtime\.tensor_parallel|compression\.compress|init_inference|inference|sequence|"
                      r"runtime\.sequence_parallel|runtime\.data_pipeline|runtime\.state_dict_factory|"
                      r"runtime\.utils\.PartitionedTensor|utils\.groups\._get_expert)")


def resolve(name: str):
    """The object ``name`` denotes: ``import deepspeed.a``, ``deepspeed.a.b.C``, ``deepspeed.f().attr``.

    Raises:
        Exception: whatever importing or looking it up raised.
    """
    name = name.removeprefix("import ").strip()
    parts = name.split(".")
    obj, i = None, next((k for k, p in enumerate(parts) if p.endswith("()")), len(parts))
    while i > 0:                       # the longest importable module prefix (a call ends it)
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("deepspeed"):
                raise
            i -= 1
    if obj is None:
        raise ModuleNotFoundError(name)
    for part in parts[i:]:
        call = part.endswith("()")
        obj = getattr(obj, part.removesuffix("()"))
        if call:
            obj = obj()
    return obj


def status(name: str) -> str:
    try:
        obj = resolve(name)
    except NotImplementedError as e:          # a not-built class's attribute
        return f"not built: {e}"
    except Exception as e:  # noqa: BLE001  (reported per name)
        return f"missing: {type(e).__name__}: {e}"
    return "not built" if getattr(obj, "__not_built__", False) else "provided"


def library_names(package: str) -> set[str]:
    """Every ``deepspeed.*`` module, ``from deepspeed... import`` name and ``deepspeed.a.b`` attribute chain in
    ``package``'s source, where the file imports ``deepspeed`` itself (a local called deepspeed is skipped)."""
    spec = importlib.util.find_spec(package)
    root = Path(next(iter(spec.submodule_search_locations)))
    found: set[str] = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "deepspeed" not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        imports_module = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "deepspeed" or a.name.startswith("deepspeed."):
                        found.add(f"import {a.name}")
                        imports_module |= a.name == "deepspeed" and a.asname is None
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed" \
                    and node.level == 0:
                found.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
        if not imports_module:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
                chain = ast.unparse(node)
                if chain.startswith("deepspeed.") and re.fullmatch(r"[A-Za-z_][\w.]*", chain):
                    found.add(chain)
    # keep only the longest chains (deepspeed.zero is implied by deepspeed.zero.Init)
    return {n for n in found if not any(m != n and m.startswith(n + ".") for m in found)}


if __name__ == "__main__":
    print(json.dumps({n: status(n) for n in (line.strip() for line in sys.stdin) if n}))
