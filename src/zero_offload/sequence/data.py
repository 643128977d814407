"""``UlyssesSPDataLoaderAdapter``: each rank's batches, shared out along the sequence (DeepSpeed 0.19.8's adapter).

The ``P`` ranks of a sequence-parallel group each load their own batch, as under data parallelism. The adapter
gathers the ``P`` batches and hands them out one per step: at step ``i`` of a round every rank of the group gets
its shard (``seq / P`` consecutive positions, in group-rank order) of the batch group rank ``i`` loaded. So a
round of ``P`` steps trains the same samples that one step of plain data parallelism would, and ``len`` is
``P x len(dataloader)``.

Each batch is a dict of ``(batch, seq, ...)`` tensors with ``input_ids``, ``position_ids`` and ``labels``; other
values are shared as they are. ``labels`` become ``shift_labels`` (shifted left once over the whole sequence, ``-100``
past the end) before the split, so the token after each shard's last position is still predicted. Shards come
back on the CPU (at millions of tokens the round's buffer is GBs); move each batch to the device as usual.
"""
from __future__ import annotations

from collections import deque

import torch

from zero_offload import comm

__all__ = ["UlyssesSPDataLoaderAdapter", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def _gather_tensor(t: torch.Tensor, lengths: list[int], group, size: int) -> list[torch.Tensor]:
    """Every group rank's ``t`` (``(batch, lengths[r], ...)``), padded to the longest for the gather."""
    longest = max(lengths)
    padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1])) if t.dim() >= 2 else t
    parts = torch.empty((size, *padded.shape), dtype=t.dtype, device=t.device)
    comm.all_gather_into(parts.view(-1), padded.contiguous().view(-1), group)
    return [parts[r][:, :lengths[r]] if t.dim() >= 2 else parts[r] for r in range(size)]


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` (any iterable of dict batches) for the sequence-parallel group ``sp_group`` (DeepSpeed's
    arguments: ``sp_rank``, ``sp_group``, ``sp_world_size``, ``device``: where the gather runs).

    Raises (on iteration):
        ValueError: a batch without ``position_ids``, a tensor whose sequence length differs from
            ``input_ids``', or a sequence length not divisible by ``sp_world_size`` (the message names the key).
    """

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = torch.device(device) if not isinstance(device, torch.device) else device
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather the next batch of every group rank and queue this rank's shard of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)      # the next epoch starts from a fresh iterator
            raise
        if "position_ids" not in batch:
            raise ValueError("UlyssesSPDataLoaderAdapter: every batch needs position_ids, so that each token keeps "
                             "its global position after the sequence is split (unpacked sequences: "
                             "torch.arange(seq_len) per sample; packed: restart at each document)")
        size, group = self.sp_world_size, self.sp_group
        seqlen = batch["input_ids"].shape[1]
        lengths = torch.zeros(size, dtype=torch.int64, device=self.device)
        comm.all_gather_into(lengths, torch.tensor([seqlen], dtype=torch.int64, device=self.device), group)
        lengths = lengths.tolist()
        per_rank: list[dict] = [{} for _ in range(size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                value = value.to(self.device)
                if value.dim() < 2 or value.shape[1] != seqlen:
                    raise ValueError(f"UlyssesSPDataLoaderAdapter: batch[{key!r}] has shape {tuple(value.shape)}, "
                                     f"but input_ids has sequence length {seqlen}")
                with torch.no_grad():
                    parts = _gather_tensor(value, lengths, group, size)
            else:
                parts = comm.gather_objects(value, group)
            for r, part in enumerate(parts):
                per_rank[r][key] = part
        for sample in per_rank:
            self.micro_batches.append(self._shard(sample))

    def _shard(self, batch: dict) -> dict:
        length = batch["input_ids"].shape[1]
        if length % self.sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sequence length {length} is not divisible by the "
                             f"sequence-parallel size {self.sp_world_size}")
        chunk = length // self.sp_world_size
        labels = batch.pop("labels", None)
        if labels is not None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
            batch["shift_labels"] = labels[..., 1:].contiguous()
        lo = chunk * self.sp_rank
        return {k: (v[:, lo:lo + chunk].cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
