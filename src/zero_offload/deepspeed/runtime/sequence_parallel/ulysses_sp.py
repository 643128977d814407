"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed 0.19.8's ALST components under their names --
Ulysses sequence parallelism for Hugging Face models (`zero_offload.sequence`: ``UlyssesSPAttentionHF``,
``UlyssesSPDataLoaderAdapter``) and the sequence-tiled compute (`zero_offload.tiling`: ``TiledMLP``,
``TiledFusedLogitsLoss``, ``SequenceTiledCompute``, ``sequence_tiled_compute``); docs/long-sequences.md. Every other
name imports; using one raises `zero_offload.compat.unbuilt.NotBuiltError`, which says what to use instead."""
from zero_offload.compat.unbuilt import INSTEAD, unbuilt_module_getattr
from zero_offload.sequence import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from zero_offload.tiling import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "TiledFusedLogitsLoss",
           "SequenceTiledCompute", "sequence_tiled_compute"]

__getattr__ = unbuilt_module_getattr("deepspeed.runtime.sequence_parallel.ulysses_sp", INSTEAD["sequence"])
