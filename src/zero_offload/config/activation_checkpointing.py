"""The ``activation_checkpointing`` section: DeepSpeed 0.19.8's keys, of which ``cpu_checkpointing`` is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zero_offload.config.compat import IGNORED_ACTIVATION_CHECKPOINTING
from zero_offload.config.schema import option

__all__ = ["ActivationCheckpointingConfig"]


@dataclass
class ActivationCheckpointingConfig:
    IGNORED: ClassVar[dict[str, str]] = IGNORED_ACTIVATION_CHECKPOINTING
    cpu_checkpointing: bool = option(False, "Keep the inputs of checkpointed layers in pinned host memory between the "
                                            "forward and their recompute, copied on copy streams (any "
                                            "torch.utils.checkpoint or deepspeed.checkpointing.checkpoint: Hugging "
                                            "Face gradient checkpointing included); training is bitwise the same "
                                            "(zero_offload.offload.checkpoint_offload).")
    cpu_checkpointing_min_bytes: int = option(1 << 20, "Not a DeepSpeed key: checkpoint inputs smaller than this "
                                                       "(bytes) stay on the device.", min=0)
    cpu_checkpointing_prefetch: int = option(2, "Not a DeepSpeed key: copies up queued ahead of backward's need.",
                                             min=1)
    cpu_checkpointing_device_inputs: int = option(0, "Not a DeepSpeed key: with cpu_checkpointing, the first N "
                                                     "checkpoint inputs of each forward stay on the device (the last "
                                                     "always does): the planner splits them between the device and "
                                                     "the host where neither holds them all.", min=0)
    cpu_layers: int = option(0, "Not a DeepSpeed key: the first N blocks of the model (the entries of its longest "
                                "ModuleList) keep every activation they save in pinned host memory instead of on the "
                                "device, copied on copy streams, not recomputed; for blocks that are not "
                                "checkpointed (transformers' every_n_layers); bitwise the same "
                                "(zero_offload.offload.checkpoint_offload).", min=0)
