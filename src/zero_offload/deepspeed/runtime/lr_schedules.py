"""``deepspeed.runtime.lr_schedules``: DeepSpeed 0.19.8's schedules, constructed with DeepSpeed's keyword
arguments (``WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=None, warmup_num_steps=1000, ...)``), over
zero-offload's own (`zero_offload.optim.lr_schedules`), and the names of its constants."""
from __future__ import annotations

from zero_offload.config import Config
from zero_offload.optim import lr_schedules as ours

__all__ = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
           "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "get_config_from_args"]

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _schedule(name: str):
    base = ours.SCHEDULES[name]

    def __init__(self, optimizer, *args, last_batch_iteration: int = -1, **kwargs):   # noqa: N807
        if args:
            raise TypeError(f"{name}: give its settings by keyword, as DeepSpeed's documentation does")
        section = {"type": name, "params": kwargs}
        params = Config.from_dict({"train_micro_batch_size_per_gpu": 1, "scheduler": section}).scheduler.params
        base.__init__(self, getattr(optimizer, "optimizer", optimizer), params)
        for _ in range(last_batch_iteration + 1):    # resume part-way, as DeepSpeed's last_batch_iteration
            self.step()

    return type(name, (base,), {"__init__": __init__, "__module__": __name__,
                                "__doc__": f"DeepSpeed's {name}(optimizer, **its settings); see "
                                           f"zero_offload.optim.lr_schedules.{name}. Raises ConfigError naming "
                                           f"a bad setting."})


WarmupLR = _schedule(WARMUP_LR)
WarmupDecayLR = _schedule(WARMUP_DECAY_LR)
WarmupCosineLR = _schedule(WARMUP_COSINE_LR)
OneCycle = _schedule(ONE_CYCLE)
LRRangeTest = _schedule(LR_RANGE_TEST)


def get_config_from_args(args):
    """DeepSpeed reads a schedule from ``args.lr_schedule``; returns (None, reason) as DeepSpeed does without."""
    if not hasattr(args, LR_SCHEDULE) or args.lr_schedule is None:
        return None, "--{} not specified on command line".format(LR_SCHEDULE)
    if args.lr_schedule not in VALID_LR_SCHEDULES:
        return None, "{} is not supported LR schedule".format(args.lr_schedule)
    return {"type": args.lr_schedule, "params": {}}, None
