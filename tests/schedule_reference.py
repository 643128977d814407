"""A plain-Python reference of DeepSpeed 0.19.8's learning-rate schedules, for tests that run without DeepSpeed.

Written from the semantics of ``deepspeed/runtime/lr_schedules.py`` in the 0.19.8 release (the PyPI sdist),
as closed forms of ``k``, the number of optimizer steps taken so far (DeepSpeed's ``last_batch_iteration + 1``;
k = 0 is the state the schedule's constructor leaves). Every function returns what the optimizer's param groups
hold after k steps, so a test reads the engine's groups after each step and compares.

Facts carried over from that source, some of them surprising:

- WarmupLR / WarmupDecayLR: warm up over W = max(2, warmup_num_steps) steps; the rate of step index i = k - 1 is
  min + (max - min) x gamma, gamma = log(i + 1) / log(W) ("log") or i / W ("linear") while i < W, so the first
  two rates (k = 0 and k = 1) are both warmup_min_lr. WarmupLR's warmup_max_lr defaults to each group's own lr;
  WarmupDecayLR's defaults to 0.001. After warm-up WarmupDecayLR's gamma is max(0, (T - i) / max(1, T - W)).
- WarmupCosineLR: ratio x each group's lr at construction; 0 at k = 0; warm-up from warmup_min_ratio to 1 with
  the same gamma; then cos_min_ratio + (1 - cos_min_ratio) (1 + cos(pi p)) / 2 with p = min(1, (i - W + 1) /
  max(1, T - W)), floored at 0.
- LRRangeTest: min_lr x (1 + step_rate x k / step_size), with k / step_size floored when staircase.
- OneCycle: the cycle has a rising half of s1 = cycle_first_step_size steps and a falling half of s2 =
  cycle_second_step_size (default s1). At k = 0 lr = cycle_min_lr and, with cycle_momentum, betas =
  (cycle_min_mom, 0.99): beta1 starts at its *minimum*, not at the max the cycle formula would give. For
  1 <= k <= s1 + s2 the cycle position is f = k / s1 rising, (s1 + s2 - k) / s2 falling, and 0 at k = s1 + s2
  even when s2 = 0 (the peak is then never reached); a stair count n > 0 for that half replaces f by
  floor(f x n) / n. lr = min_lr + (max_lr - min_lr) f; beta1 = max_mom - (max_mom -
  min_mom) f. beta2 is always 0.99, whatever the optimizer's was: DeepSpeed writes (beta1, 0.99).
  cycle_second_stair_count defaults to cycle_first_stair_count. After the cycle, with d = k - (s1 + s2), the
  decay is continuous (d / decay_step_size is not floored): lr = min_lr / (1 + decay_lr_rate x d / step),
  beta1 = max_mom x (1 + decay_mom_rate x d / step) (it grows); with decay_step_size 0 or a rate of 0 the
  value stays at min_lr (lr) or max_mom (beta1). Momentum is cycled only for optimizers with betas.
"""
from __future__ import annotations

import math

__all__ = ["warmup_lr", "warmup_decay_lr", "warmup_cosine_lr", "lr_range_test", "one_cycle", "expected"]


def _warmup_gamma(i: int, warmup: int, kind: str) -> float:
    return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup


def _warmup(k: int, p: dict, group_lrs: list[float], default_max, after) -> list[float]:
    """min + (max - min) x gamma; ``after(i, warmup)`` is gamma once warm-up is over."""
    lo = p.get("warmup_min_lr", 0.0)
    peak = p.get("warmup_max_lr", default_max)
    his = [lr if peak is None else peak for lr in group_lrs]   # None: each group's own lr
    warmup = max(2, p.get("warmup_num_steps", 1000))
    i = k - 1
    if k == 0:
        gamma = 0.0
    elif i < warmup:
        gamma = _warmup_gamma(i, warmup, p.get("warmup_type", "log"))
    else:
        gamma = after(i, warmup)
    return [lo + (hi - lo) * gamma for hi in his]


def warmup_lr(k: int, p: dict, group_lrs: list[float]) -> list[float]:
    return _warmup(k, p, group_lrs, None, lambda i, warmup: 1.0)


def warmup_decay_lr(k: int, p: dict, group_lrs: list[float]) -> list[float]:
    total = p["total_num_steps"]
    return _warmup(k, p, group_lrs, 0.001, lambda i, warmup: max(0.0, (total - i) / max(1, total - warmup)))


def warmup_cosine_lr(k: int, p: dict, group_lrs: list[float]) -> list[float]:
    warmup = max(2, p.get("warmup_num_steps", 1000))
    floor_ratio, cos_min = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 0.0001)
    i = k - 1
    if k == 0:
        ratio = 0.0
    elif i < warmup:
        ratio = floor_ratio + (1.0 - floor_ratio) * _warmup_gamma(i, warmup, p.get("warmup_type", "log"))
    else:
        progress = min(1.0, (i - warmup + 1) / max(1, p["total_num_steps"] - warmup))
        ratio = max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
    return [lr * ratio for lr in group_lrs]


def lr_range_test(k: int, p: dict, group_lrs: list[float]) -> list[float]:
    size = p.get("lr_range_test_step_size", 2000)
    intervals = k // size if p.get("lr_range_test_staircase", False) else k / size
    lr = p.get("lr_range_test_min_lr", 1e-3) * (1 + p.get("lr_range_test_step_rate", 1.0) * intervals)
    return [lr for _ in group_lrs]


def _cycle_position(k: int, p: dict) -> float:
    """Where step k (1 <= k <= s1 + s2) is in the cycle: 0 at the bottom, 1 at the peak."""
    s1 = p.get("cycle_first_step_size", 2000)
    s2 = p["cycle_second_step_size"] if p.get("cycle_second_step_size") is not None else s1
    n1 = p.get("cycle_first_stair_count", 0)
    n2 = p["cycle_second_stair_count"] if p.get("cycle_second_stair_count") is not None else n1
    c = k % (s1 + s2)   # the last step of the cycle is at 0 again, even the peak when s2 = 0
    if c <= s1:
        return (c * n1 // s1) / n1 if n1 > 0 else c / s1     # integer floor: exact at every stair
    return ((s1 + s2 - c) * n2 // s2) / n2 if n2 > 0 else (s1 + s2 - c) / s2


def one_cycle(k: int, p: dict, group_lrs: list[float], group_betas: list[tuple]) -> tuple[list, list]:
    """(lrs, betas) per group after k steps. ``group_betas`` are the optimizer's (None: it has no betas)."""
    s1 = p.get("cycle_first_step_size", 2000)
    s2 = p["cycle_second_step_size"] if p.get("cycle_second_step_size") is not None else s1
    min_lr, max_lr = p["cycle_min_lr"], p["cycle_max_lr"]
    min_mom, max_mom = p.get("cycle_min_mom", 0.8), p.get("cycle_max_mom", 0.9)
    step, lr_rate, mom_rate = p.get("decay_step_size", 0), p.get("decay_lr_rate", 0.0), p.get("decay_mom_rate", 0.0)
    if k == 0:
        lr, mom = min_lr, min_mom
    elif k <= s1 + s2:
        f = _cycle_position(k, p)
        lr, mom = min_lr + (max_lr - min_lr) * f, max_mom - (max_mom - min_mom) * f
    else:
        d = k - (s1 + s2)
        lr = min_lr / (1 + lr_rate * d / step) if step and lr_rate else min_lr
        mom = max_mom * (1 + mom_rate * d / step) if step and mom_rate else max_mom
    cycles = p.get("cycle_momentum", True) and all(b is not None for b in group_betas)
    betas = [(mom, 0.99) if cycles else b for b in group_betas]
    return [lr for _ in group_lrs], betas


def expected(name: str, p: dict, steps: int, group_lrs: list[float], group_betas: list[tuple]) -> list:
    """[(lrs, betas)] for k = 0 .. steps: what each param group holds after k optimizer steps."""
    out = []
    for k in range(steps + 1):
        if name == "OneCycle":
            out.append(one_cycle(k, p, group_lrs, group_betas))
            continue
        fn = {"WarmupLR": warmup_lr, "WarmupDecayLR": warmup_decay_lr, "WarmupCosineLR": warmup_cosine_lr,
              "LRRangeTest": lr_range_test}[name]
        out.append((fn(k, p, group_lrs), list(group_betas)))
    return out
