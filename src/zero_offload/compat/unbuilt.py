"""DeepSpeed features zero-offload does not build: importable, and failing when used, with what to use instead.

Real codebases import DeepSpeed's pipeline, tensor- and expert-parallel, compression and inference names at the
top of files that also hold the data-parallel code they run (Megatron-DeepSpeed, DeepSpeed-Chat). Those imports
must succeed; only a call, an instantiation or a subclass's instantiation fails, with `NotBuiltError` naming the
DeepSpeed name and the alternative.
"""
from __future__ import annotations

__all__ = ["NotBuiltError", "unbuilt", "unbuilt_module_getattr", "INSTEAD"]

# What to use instead, by the feature a DeepSpeed module belongs to.
INSTEAD = {
    "pipeline": "train data parallel with ZeRO stage 3 (and offload) instead of pipeline parallelism",
    "experts": "a mixture-of-experts model trains data parallel at stage 3 with "
               "deepspeed.utils.set_z3_leaf_modules",
    "compression": "compress with a dedicated library (e.g. torch.ao) after training",
    "inference": "generate with transformers' generate() on engine.module (or vLLM)",
    "sequence": "Megatron-style DistributedAttention and FPDT are not built; Ulysses for Hugging Face models is "
                "(deepspeed.runtime.sequence_parallel.ulysses_sp, docs/long-sequences.md)",
    "tensor": "train data parallel with ZeRO stage 3 instead of tensor parallelism",
    "data": "use a torch DataLoader instead of DeepSpeed's data-efficiency pipeline",
    "profiler": "use torch.profiler or zero-offload's engine.timings",
    "megatron": "load a zero-offload, DeepSpeed or DCP checkpoint with engine.load_checkpoint",
    "hybrid": "build a frozen engine (deepspeed.initialize with no optimizer) for generation",
}


class NotBuiltError(NotImplementedError):
    """A DeepSpeed feature zero-offload does not build was used (not merely imported)."""


class _NotBuiltAttribute(NotBuiltError, AttributeError):
    """A class attribute of a stand-in: an AttributeError too, so ``hasattr`` and introspection see none."""


def _message(name: str, instead: str) -> str:
    return f"{name} is not built in zero-offload (it trains data parallel with ZeRO 0-3 and offload); {instead}"


def unbuilt(name: str, instead: str) -> type:
    """A class standing for DeepSpeed's ``name``: it can be imported, subclassed and named in ``isinstance``;
    creating one, or calling one of its class methods, raises `NotBuiltError`. Its ``__not_built__`` is True.

    Raises (when used):
        NotBuiltError: the message names ``name`` and ``instead``.
    """
    message = _message(name, instead)

    class _Meta(type):
        def __getattr__(cls, attr):        # class-level lookups (``Cls.from_meta``, ``Cls.apply``) fail too
            if attr.startswith("__"):
                raise AttributeError(attr)
            raise _NotBuiltAttribute(f"{name}.{attr}: {message}")

    def __init__(self, *args, **kwargs):   # noqa: N807
        raise NotBuiltError(message)

    return _Meta(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": message,
                                                "__module__": name.rsplit(".", 1)[0], "__not_built__": True})


def unbuilt_module_getattr(module: str, instead: str):
    """A module ``__getattr__`` (PEP 562) for a DeepSpeed module that is not built: every public name it is asked
    for is an `unbuilt` stand-in, so ``from deepspeed.pipe import PipelineModule, LayerSpec`` imports."""
    made: dict[str, type] = {}

    def __getattr__(attr: str):   # noqa: N807
        if attr.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        if attr not in made:
            made[attr] = unbuilt(f"{module}.{attr}", instead)
        return made[attr]

    return __getattr__
