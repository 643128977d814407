"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (a config read and checked, its settings as DeepSpeed's
attribute names) and ``DeepSpeedConfigError``."""
from __future__ import annotations

from zero_offload.config import Config, ConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]

DeepSpeedConfigError = ConfigError


class DeepSpeedConfig:
    """DeepSpeed's ``DeepSpeedConfig(config, mpu=None, mesh_device=None)``: ``config`` a dict, a JSON/hjson path
    or a base64 string, read and checked as ``deepspeed.initialize`` reads it (`zero_offload.Config`).

    Attributes:
        param_dict, _param_dict: the config as given (a dict); the second is DeepSpeed's name for it.
        train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, zero_optimization_stage,
        zero_enabled, fp16_enabled, bfloat16_enabled, gradient_clipping: DeepSpeed's attribute names.

    Raises:
        ConfigError: an invalid config (the key is named).
    """

    def __init__(self, config, mpu=None, mesh_device=None):
        import os
        from zero_offload.config.io import decode_config_string, read_config_file
        if isinstance(config, dict):
            raw = dict(config)
        elif isinstance(config, str) and not os.path.exists(config) and decode_config_string(config) is not None:
            raw = decode_config_string(config)
        else:
            raw = read_config_file(config)
        self.param_dict = self._param_dict = raw
        import torch.distributed as dist
        self.config = Config.from_dict(raw)
        sizes = self.config.batch_sizes(dist.get_world_size() if dist.is_initialized() else 1)
        self.train_batch_size = sizes.train_batch_size
        self.train_micro_batch_size_per_gpu = sizes.micro_batch_per_gpu
        self.gradient_accumulation_steps = sizes.gradient_accumulation_steps
        self.zero_optimization_stage = self.config.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = self.config.fp16.enabled
        self.bfloat16_enabled = self.config.bf16.enabled
        self.gradient_clipping = self.config.gradient_clipping
