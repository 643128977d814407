"""Rules of the house that the code itself can be checked for (ARCHITECTURE.md, issue 19)."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "zero_offload"
# What a module may ask of torch.distributed without going through comm.py: the group's shape, not its data.
QUERIES = {"is_initialized", "is_available", "get_rank", "get_world_size", "get_backend", "init_process_group",
           "get_process_group_ranks", "get_global_rank", "destroy_process_group", "ReduceOp", "DistError",
           "ProcessGroup", "new_group"}


@pytest.mark.parametrize("path", sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")))
def test_only_comm_calls_collectives(path):
    """Every collective goes through `zero_offload.comm` (one place to change a name torch deprecates, or to
    simulate a delayed collective)."""
    if path == "comm.py":
        return
    tree = ast.parse((SRC / path).read_text())
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
               if a.name == "torch.distributed"}
    calls = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id in aliases} - QUERIES)
    assert calls == [], f"{path} calls torch.distributed.{', '.join(calls)} directly; use zero_offload.comm"
