"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``): ``configure``,
``is_configured``, ``checkpoint``, and the model-parallel RNG tracker Megatron-style code seeds through.

``checkpoint(function, *args)`` recomputes ``function`` in backward, as DeepSpeed's (torch's reentrant
checkpoint, RNG state restored, so dropout matches). Of ``configure``'s switches, ``partition_activations`` and
``contiguous_memory_optimization`` concern tensor parallelism and change nothing at data parallelism;
``checkpoint_in_cpu`` keeps the inputs of checkpointed layers in host memory in engines built afterwards, as the
config's ``activation_checkpointing.cpu_checkpointing`` does, for any checkpoint function
(`zero_offload.offload.checkpoint_offload`); training is bitwise the same.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from zero_offload.offload.checkpoint_offload import request

__all__ = ["configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset", "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker",
           "set_num_layers"]

_MODEL_PARALLEL_RNG = "model-parallel-rng"
_settings: dict | None = None


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Record the activation-checkpointing settings (arguments override the config's
    ``activation_checkpointing`` section, as DeepSpeed's).

    Raises:
        ValueError: ``mpu_`` with model parallelism (`zero_offload.compat.mpu.check_mpu`).
    """
    global _settings
    section = {}
    if deepspeed_config is not None:
        from zero_offload.deepspeed.runtime.config import DeepSpeedConfig
        raw = deepspeed_config if isinstance(deepspeed_config, dict) else DeepSpeedConfig(deepspeed_config).param_dict
        section = dict(raw.get("activation_checkpointing") or {})
    if mpu_ is not None:
        from zero_offload.compat.mpu import check_mpu
        check_mpu(mpu_)
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    section.update({k: v for k, v in given.items() if v is not None})
    # Engines built from now on keep checkpoint inputs in host memory (zero_offload.offload.checkpoint_offload).
    request(bool(section.get("cpu_checkpointing")))
    _settings = section


def is_configured() -> bool:
    return _settings is not None


def reset() -> None:
    """DeepSpeed frees its contiguous activation buffers here; zero-offload keeps none."""


def set_num_layers(nlayers) -> None:
    """Accepted (DeepSpeed sizes its contiguous buffers by it)."""


def checkpoint(function, *args):
    """``function(*args)``, its activations recomputed in backward (DeepSpeed's ``CheckpointFunction``)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True)


def non_reentrant_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)


def _device_rng():
    return torch.cuda if torch.cuda.is_available() else torch


class CudaRNGStatesTracker:
    """Named RNG states (Megatron's tracker): ``add(name, seed)``, then ``with fork(name):`` draws from that
    state and leaves the default one as it was. On a machine with no GPU it tracks the CPU generator."""

    def __init__(self):
        self.states_: dict = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Raises: Exception (as DeepSpeed's): a seed or a name already added."""
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        rng = _device_rng()
        previous = rng.get_rng_state()
        rng.manual_seed(seed)
        self.states_[name] = rng.get_rng_state()
        rng.set_rng_state(previous)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        rng = _device_rng()
        previous = rng.get_rng_state()
        rng.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = rng.get_rng_state()
            rng.set_rng_state(previous)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the model-parallel state with ``seed + 2718`` (Megatron's
    offset; the tensor-parallel rank is 0 here)."""
    _TRACKER.reset()
    _device_rng().manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    model_parallel_cuda_manual_seed(seed)
