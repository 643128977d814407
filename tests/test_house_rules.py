"""Rules of the house that the code itself can be checked for (ARCHITECTURE.md, issue 19)."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "zero_offload"
# What a module may ask of torch.distributed without going through comm.py: the group's shape, not its data.
QUERIES = {"is_initialized", "is_available", "get_rank", "get_world_size", "get_backend", "init_process_group",
           "get_process_group_ranks", "get_global_rank", "destroy_process_group", "ReduceOp", "DistError",
           "ProcessGroup", "new_group", "HashStore",     # HashStore: the store of a one-rank group
           "group", "P2POp"}     # group.WORLD and the P2POp type, which deepspeed.comm names (no data moves)


@pytest.mark.parametrize("path", sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")))
def test_only_comm_calls_collectives(path):
    """Every collective goes through `zero_offload.comm` (one place to change a name torch deprecates, or to
    simulate a delayed collective)."""
    if path == "comm/__init__.py":
        return
    tree = ast.parse((SRC / path).read_text())
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
               if a.name == "torch.distributed"}
    calls = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id in aliases} - QUERIES)
    assert calls == [], f"{path} calls torch.distributed.{', '.join(calls)} directly; use zero_offload.comm"


# Names outside this package whose private attributes are read on purpose: torch's internals (no public API for
# a storage's identity or autograd's graph-task id) and the two native loaders' one face.
FOREIGN_OK = {"torch", "_C", "ctypes", "os", "sys"}
FACES = {"native.py": {"_native"}}
# torch's private names read on purpose: nn.Module's own tables (the only way to see a module's own parameters and
# buffers with their None entries, and which buffers persist; torch's FSDP reads them too) and a storage's
# identity (`_cdata`: it survives resizing to 0 bytes, which data_ptr does not), and a tensor's C++ reference count
# (`_use_count`: the only way to see that a backend's worker still refers to it, `comm_handover`).
TORCH_PRIVATE = {"_parameters", "_buffers", "_non_persistent_buffers_set", "_cdata", "_use_count"}
# The loader that stands in for transformers' own ``_load_pretrained_model`` (and the two peft methods it wraps, by
# name) keeps transformers' loading protocol: the flag its loader sets on each loaded tensor, which its
# ``_init_weights`` skips, the conversions a model records for ``save_pretrained``, and the device transformers
# kernelizes for when the parameters are on meta (it sets it itself for a ``device_map``'s offloaded ones).
LIBRARY_PROTOCOL = {"hf/pretrained.py": {"_is_hf_initialized", "_weight_conversions", "_kernels_device"},
                    "compat/zero.py": {"_kernels_device"},     # deepspeed.zero.Init under transformers' from_pretrained
                    # numpy's array rebuilder: the name every pickled ndarray names (torch's weights_only docs)
                    "checkpoint/safe_pickle.py": {"_reconstruct"},
                    # the checkpoint function transformers' _set_gradient_checkpointing gives each layer and its
                    # GradientCheckpointingLayer calls: the one place its offload=True wrapper can be replaced
                    "offload/hf_checkpoint_offload.py": {"_gradient_checkpointing_func"}}


@pytest.mark.parametrize("path", sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")))
def test_no_private_name_is_used_across_modules(path):
    """A module reaches another only through its public names (rules of the house, ARCHITECTURE.md)."""
    tree = ast.parse((SRC / path).read_text())
    package = "zero_offload." + ".".join(Path(path).parent.parts) if Path(path).parent.parts else "zero_offload"
    wrong = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("zero_offload"):
            for a in n.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and n.module != package and a.name not in FACES.get(path, ()):
                    wrong.append(f"from {n.module} import {a.name}")
        if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and n.attr not in TORCH_PRIVATE and n.attr not in LIBRARY_PROTOCOL.get(path, ())):
            owner = ast.unparse(n.value)
            if owner not in {"self", "cls", "super()"} and owner.split(".")[0] not in FOREIGN_OK:
                wrong.append(f"{owner}.{n.attr}")
    assert wrong == [], f"{path} uses private names of other modules: {', '.join(sorted(set(wrong)))}"
