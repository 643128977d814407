"""Ulysses attention around any Hugging Face attention function (DeepSpeed 0.19.8's ``UlyssesSPAttentionHF``).

Each rank holds a shard of the sequence. Queries, keys and values go through `exchange.gather_sequence` (each rank
then holds the whole sequence for ``heads / P`` heads), the model's own attention function (sdpa, flash, ...)
runs unchanged on them, and `exchange.scatter_sequence` brings the output back to the sequence split. Exact: the
attention of every head sees every position (DeepSpeed-Ulysses, arXiv 2309.14509, section 3; ALST, arXiv
2506.13996, section 3.1).

As DeepSpeed does:
- ``position_ids`` are required in every forward (each rank's shard carries its global positions; they are
  gathered for the attention function, which uses them to tell packed documents apart);
- a dense 4-D ``attention_mask`` is dropped (it was built for the local shard; causality comes from the gathered
  sequence), so ``eager`` attention, which needs one, is refused;
- fewer key/value heads than ranks are replicated until each rank has one (``kv_heads`` must divide ``P`` or be a
  multiple of it), and ``module.num_key_value_groups`` says so during the call (restored after it).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zero_offload import comm
from zero_offload.sequence.exchange import gather_sequence, scatter_sequence

__all__ = ["UlyssesSPAttentionHF"]


class UlyssesSPAttentionHF(torch.nn.Module):
    """A Hugging Face attention function made sequence parallel over ``process_group``.

    Args (DeepSpeed's names): ``attn`` the core attention function (``ALL_ATTENTION_FUNCTIONS[...]``);
    ``batch_size``; ``attn_head_count``, ``attn_head_size``, ``kv_head_count``; ``num_hidden_layers``;
    ``process_group`` (the sequence-parallel group); ``seq_length_is_variable`` (shapes read from every batch),
    else ``local_seq_length`` and ``global_seq_length`` are checked against each batch; ``disable_in_eval``
    (an eval-mode forward sees the whole sequence on every rank and bypasses the exchange).

    Call: ``(module, query, key, value, attention_mask, *args, **kwargs)`` with query ``(B, H, S/P, D)`` and key,
    value ``(B, H_kv, S/P, D)``; returns ``((B, S/P, H, D), attention weights or None)``, as HF's functions do.

    Raises:
        ValueError: head counts that do not divide the group size, a missing ``position_ids`` or shapes that
            differ from the fixed ``local_seq_length`` / ``batch_size``.
    """

    def __init__(self, attn: Callable, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False, world_size: int | None = None):
        super().__init__()
        self.attn, self.process_group = attn, process_group
        self.world_size = world_size or (torch.distributed.get_world_size(process_group)
                                         if process_group is not None else 1)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = (attn_head_count, attn_head_size,
                                                                                 kv_head_count)
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.core_attn_implementation: str | None = None
        size = self.world_size
        if attn_head_count % size:
            raise ValueError(f"attention head count {attn_head_count} is not divisible by the sequence-parallel "
                             f"size {size}")
        if kv_head_count % size and size % kv_head_count:
            raise ValueError(f"key/value head count {kv_head_count} is not divisible by the sequence-parallel size "
                             f"{size} or vice versa")
        self.kv_replication_factor = max(1, size // kv_head_count)

    def _check_shapes(self, query: torch.Tensor) -> None:
        if self.seq_length_is_variable:
            return
        batch, _, local, _ = query.shape
        if local != self.local_seq_length or batch != self.batch_size:
            raise ValueError(f"UlyssesSPAttentionHF: query of batch {batch} and local sequence {local}, but "
                             f"seq_length_is_variable=False fixed batch {self.batch_size} and local sequence "
                             f"{self.local_seq_length}; pass seq_length_is_variable=True for varying lengths")

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any):
        if (not module.training and self.disable_in_eval) or self.world_size == 1:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every forward: each rank's shard "
                             "must carry its global positions (UlyssesSPDataLoaderAdapter keeps them; for "
                             "unpacked sequences position_ids = torch.arange(seq_len) per sample)")
        self._check_shapes(query)
        kwargs["position_ids"] = self._gather_positions(kwargs["position_ids"])
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        group, size = self.process_group, self.world_size
        q, k, v = (gather_sequence(t, group, size) for t in (query, key, value))
        saved = getattr(module, "num_key_value_groups", None)
        if saved is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            out, weights = self.attn(module, q, k, v, None, *args, **kwargs)     # (B, S, H/P, D)
        finally:
            if saved is not None:
                module.num_key_value_groups = saved
        out = scatter_sequence(out.transpose(1, 2).contiguous(), group, size)  # (B, H, S/P, D)
        return out.transpose(1, 2), weights

    def _gather_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        parts = torch.empty((self.world_size, *position_ids.shape), dtype=position_ids.dtype,
                            device=position_ids.device)
        comm.all_gather_into(parts.view(-1), position_ids.contiguous().view(-1), self.process_group)
        return torch.cat(list(parts), dim=-1)

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None):
        """Make the sequence-parallel groups and put Ulysses around ``core_attn_implementation`` in transformers'
        ``ALL_ATTENTION_FUNCTIONS``; returns the ``mpu`` to pass to ``deepspeed.initialize`` (None at size 1).
        See `zero_offload.sequence.hf_registration.register_with_transformers`."""
        from zero_offload.sequence.hf_registration import register_with_transformers
        return register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                          micro_batch_size, seq_length, seq_length_is_variable, disable_in_eval,
                                          max_length)
