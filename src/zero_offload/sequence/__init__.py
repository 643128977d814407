"""Ulysses sequence parallelism: the ranks of a group share one sequence (DeepSpeed-Ulysses, arXiv 2309.14509; ALST,
arXiv 2506.13996; docs/long-sequences.md).

- `groups`: the sequence-parallel process groups (DeepSpeed's ``parallel_state_sp``; the ``mpu``);
- `exchange`: the all-to-all between sequence shards and head shards;
- `attention`: ``UlyssesSPAttentionHF``, Ulysses around a Hugging Face attention function, and
  `hf_registration` (``register_with_transformers``);
- `data`: ``UlyssesSPDataLoaderAdapter``, each batch split along the sequence;
- `loss`: the sequence's loss from its shards' losses, with exact gradients.
"""
from zero_offload.sequence.attention import UlyssesSPAttentionHF
from zero_offload.sequence.data import UlyssesSPDataLoaderAdapter
from zero_offload.sequence.groups import SequenceParallelError, SequenceParallelGroups, current, initialize
from zero_offload.sequence.loss import sequence_loss

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "SequenceParallelGroups", "SequenceParallelError",
           "current", "initialize", "sequence_loss"]
