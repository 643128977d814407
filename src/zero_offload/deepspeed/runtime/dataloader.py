"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` and ``DeepSpeedDataLoader``."""
from __future__ import annotations

import torch

__all__ = ["RepeatingLoader", "DeepSpeedDataLoader"]


class RepeatingLoader:
    """Wraps an iterator to restart it at its end, forever (DeepSpeed's ``RepeatingLoader``)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader(torch.utils.data.DataLoader):
    """DeepSpeed's training loader: ``batch_size`` samples from a ``DistributedSampler`` over the
    data-parallel ranks (``data_parallel_world_size``, ``data_parallel_rank``), as ``deepspeed.initialize``
    builds it for ``training_data``."""

    def __init__(self, dataset, batch_size, pin_memory=False, local_rank=0, tput_timer=None, collate_fn=None,
                 num_local_io_workers=None, data_sampler=None, data_parallel_world_size=None,
                 data_parallel_rank=None, dataloader_drop_last=False, deepspeed_dataloader_config=None):
        import torch.distributed as dist
        world = data_parallel_world_size or (dist.get_world_size() if dist.is_initialized() else 1)
        rank = data_parallel_rank if data_parallel_rank is not None else (dist.get_rank() if dist.is_initialized()
                                                                          else 0)
        sampler = data_sampler or torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                         pin_memory=pin_memory, num_workers=num_local_io_workers or 0, drop_last=dataloader_drop_last)
