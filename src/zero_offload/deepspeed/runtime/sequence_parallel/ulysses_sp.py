"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: its sequence-tiled compute is built (`zero_offload.tiling`:
``TiledMLP``, ``TiledFusedLogitsLoss``, ``SequenceTiledCompute``, ``sequence_tiled_compute``; docs/long-sequences.md);
Ulysses sequence parallelism is not. Every other name imports; using one raises
`zero_offload.compat.unbuilt.NotBuiltError`, which says what to use instead."""
from zero_offload.compat.unbuilt import INSTEAD, unbuilt_module_getattr
from zero_offload.tiling import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = ["TiledMLP", "TiledFusedLogitsLoss", "SequenceTiledCompute", "sequence_tiled_compute"]

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.sequence_parallel.ulysses_sp", INSTEAD["sequence"])
