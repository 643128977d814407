"""A plain-PyTorch reference of 16-bit (bf16, fp16) training that rounds where the engine promises to round,
stepped in lockstep with the engine so that its bound stays at a few ulp.

What one reference step does, as the engine's data flow promises (DESIGN.md, "One training step"):

1. Forward and backward of every micro-batch of every data-parallel rank, one at a time, on a model held in the
   16-bit dtype: each backward starts from ``loss.float() / gas * loss_scale``, so its gradients are the 16-bit
   gradients that rank computes on that micro-batch.
2. Gradients combined as the ZeRO stage combines them, rounding to the dtype where the engine's buffers have it:
   - stages 0/1 accumulate the micro-batches in the 16-bit ``.grad`` (one rounding per addition), then average
     the accumulation over ranks in the communication dtype and round it back to the 16-bit gradient buffer;
   - stage 2 averages each micro-batch's gradient over ranks in the communication dtype, rounds the average to
     the 16-bit bucket, and accumulates the micro-batches in fp32 (in 16 bits when there is one micro-batch);
   - stage 3 reduce-scatters each micro-batch's gradient in the communication dtype into the partition, fp32
     under accumulation (nothing rounds it to 16 bits there), the 16-bit dtype when there is one micro-batch;
     one rank reduces nothing, so nothing is cast to the communication dtype then.
   Averaging over ranks divides the sum by the world size; fp16 (and stage 0's all-reduce) divides first, to
   stay in range. Two ranks' values are added in the communication dtype: one rounding, in either order.
3. The loss scale divided out in fp32, ``torch.nn.utils.clip_grad_norm_`` on the fp32 gradients, and
   ``torch.optim.AdamW`` on fp32 master weights.
4. The 16-bit weights are the masters rounded to the nearest 16-bit value.

Why lockstep. Adam turns a one-ulp difference in a gradient that is nearly zero into a difference of a whole
``lr``-sized step (the sign of ``m / sqrt(v)`` flips), and any two correct implementations whose fp32 arithmetic
differs by an ulp (our host kernel and torch's AdamW do) round some master to the other side of a 16-bit
rounding boundary within a few steps; from there two free-running trajectories drift apart by 1e-2 lr. So each
reference step starts from the engine's own masters (``full_state_dict``) and the 16-bit weights the engine's
forward must run on (the rounded masters of this step, or under the delayed update of the step before), and
checks one step: the bound below then holds every step, and a fault anywhere in the step shows in that step.

The bound of one step, per element (`Reference16.step`): both sides compute bitwise the same 16-bit gradients
(the same kernels on the same weights) and combine them with the same roundings. They differ in
- the order of the fp32 sum of squares in the global norm: relative <= log2(n) u for n <= 2**15 elements,
  so the clip coefficient and the gradients after it differ by <= 20 u relative;
- AdamW's arithmetic (our kernel and torch order the same dozen fp32 operations differently): each moment
  differs by <= 4 u relative to the sum of the magnitudes that formed it, growing by that every step;
- the rounding of the new master: <= 1 ulp of it.
With u = 2**-24, t the steps so far and A = lr (|m|hat / (sqrt(vhat) + eps) + wd |w|), where |m|hat is the
bias-corrected moving average of |g| (so cancellation inside m cannot hide an error), the masters agree within
``2 ulp(w) + (32 + 8 t) u A`` -- a few ulp of the master and of its update. The 16-bit weights agree exactly:
the engine rounds its own masters to nearest, as ``Tensor.to`` does.
"""
from __future__ import annotations

import math

import torch

from reference import LR, MICRO, train_step
from toy_model import batch, make_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
U32 = 2.0**-24
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _average(grads: list[torch.Tensor], comm: torch.dtype, divide_first: bool) -> torch.Tensor:
    """The average over ranks of one gradient, summed in ``comm`` in rank order."""
    ws = len(grads)
    parts = [g.to(comm) for g in grads]
    if divide_first:
        parts = [p / ws for p in parts]
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total if divide_first else total / ws


def combine(micro: list[list[torch.Tensor]], stage: int, dtype: torch.dtype, comm: torch.dtype,
            sum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The gradient the engine's optimizer reads for one parameter, before the loss scale is divided out.

    Args:
        micro: ``micro[r][k]``: the 16-bit gradient of rank r's micro-batch k.
        stage: the ZeRO stage (0-3).
        dtype: the training dtype; ``comm`` the communication dtype.
        sum_dtype: the dtype stages 2/3 accumulate micro-batches in (bf16 with ``bf16_master_weights_and_grads``:
            each add rounded to nearest, as torch's bf16 add rounds).
    Returns:
        The gradient in the dtype of the engine's partition: ``dtype``, or ``sum_dtype`` under accumulation at
        stages 2/3.
    """
    ws, gas = len(micro), len(micro[0])
    fp16_first = comm == torch.float16
    if stage < 2:
        acc = []
        for r in range(ws):
            a = micro[r][0].clone()
            for g in micro[r][1:]:
                a += g                                   # autograd accumulates into the 16-bit .grad
            acc.append(a)
        return _average(acc, comm, divide_first=fp16_first or stage == 0).to(dtype)
    if stage == 3 and ws == 1:
        reduced = [micro[0][k] for k in range(gas)]      # nothing to reduce-scatter
    else:
        reduced = [_average([micro[r][k] for r in range(ws)], comm, divide_first=fp16_first) for k in range(gas)]
    if stage == 2:
        reduced = [g.to(dtype) for g in reduced]         # the reduced bucket is copied back into a 16-bit bucket
    if gas == 1:
        return reduced[0].to(dtype)
    total = reduced[0].to(sum_dtype)
    for g in reduced[1:]:
        total = (total.float() + g.float()).to(sum_dtype)
    return total


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (its smallest normal spacing below the normal range)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - MANTISSA_BITS[dtype])


class Reference16:
    """One process's plain-torch replica of a 16-bit data-parallel run: every rank's micro-batches, combined
    as `combine` says, unscaled, clipped by `clip_grad_norm_` and stepped by `torch.optim.AdamW`.

    Args:
        precision: "bf16", "fp16" or "fp32" (fp32 with another ``comm`` checks communication_data_type alone).
        stage, gas, ws, clip: the ZeRO stage, accumulation steps, world size and ``gradient_clipping``.
        loss_scale: the static fp16 loss scale (1.0 otherwise).
        comm: ``communication_data_type`` ("fp32", "bf16", "fp16"); None: the training dtype.
        masters: "fp32", or bf16 masters (``bf16_master_weights_and_grads``) rounded "nearest" or "stochastic":
            gradients then accumulate in bf16, and the new master is the fp32 result rounded to bf16, so the bound
            grows by half a bf16 ulp of it (nearest) or a whole one (stochastic: either neighbour).
    """

    def __init__(self, precision: str, stage: int, gas: int, ws: int, clip: float = 0.0, loss_scale: float = 1.0,
                 comm: str | None = None, lr: float = LR, weight_decay: float = 0.01, eps: float = 1e-8,
                 masters: str = "fp32"):
        self.rounding = None if masters == "fp32" else masters
        self.dtype = DTYPES[precision]
        self.comm = DTYPES[comm] if comm else self.dtype
        self.stage, self.gas, self.ws, self.clip, self.loss_scale = stage, gas, ws, clip, loss_scale
        self.lr, self.wd, self.eps = lr, weight_decay, eps
        self.model = make_model().to(self.dtype)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, eps=eps)
        self.abs_avg = [torch.zeros_like(m) for m in self.masters]   # moving average of |g|, as exp_avg of g
        self.t = 0

    def step(self, index: int, masters: dict, weights: dict) -> dict:
        """Step ``index`` (the batch of `toy_model.batch`) from the engine's fp32 ``masters`` with the forward on
        the 16-bit ``weights`` ({name: tensor}, any float dtype holding 16-bit values).

        Returns:
            ``{"masters": {name: fp32}, "bound": {name: fp32 per-element bound}, "norm": float, "loss": float}``.
        """
        with torch.no_grad():
            for p, m, name in zip(self.params, self.masters, self.names):
                p.copy_(weights[name])
                m.copy_(masters[name])
        x, y = batch(index, MICRO * self.gas * self.ws)
        micro = [[None] * self.gas for _ in range(self.ws)]
        loss_sum = 0.0
        for r in range(self.ws):
            for k in range(self.gas):
                rows = slice((r * self.gas + k) * MICRO, (r * self.gas + k + 1) * MICRO)
                self.model.zero_grad(set_to_none=True)
                loss = self.model(x[rows], y[rows])
                scaled = loss.float() / self.gas if self.gas > 1 else loss.float()
                (scaled * self.loss_scale if self.loss_scale != 1.0 else scaled).backward()
                micro[r][k] = [p.grad.detach().clone() for p in self.params]
                loss_sum += loss.item()
        for i, m in enumerate(self.masters):
            g = combine([[micro[r][k][i] for k in range(self.gas)] for r in range(self.ws)], self.stage,
                        self.dtype, self.comm, torch.bfloat16 if self.rounding else torch.float32)
            m.grad = g.float() / self.loss_scale
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, self.clip if self.clip > 0 else math.inf))
        before = [m.detach().clone() for m in self.masters]
        self.opt.step()
        self.t += 1
        bound = {name: self.bound(m, w, a) for name, m, w, a in zip(self.names, self.masters, before, self.abs_avg)}
        return {"masters": {n: m.detach().clone() for n, m in zip(self.names, self.masters)}, "bound": bound,
                "norm": norm, "loss": loss_sum / (self.gas * self.ws)}


    def bound(self, m: torch.Tensor, before: torch.Tensor, abs_avg: torch.Tensor) -> torch.Tensor:
        """The per-element bound of master ``m`` after this step (the module docstring), ``before`` it was
        stepped; ``abs_avg`` is its moving average of |g|, updated here."""
        beta1, beta2 = self.opt.param_groups[0]["betas"]
        abs_avg.mul_(beta1).add_(m.grad.abs(), alpha=1 - beta1)
        denom = (self.opt.state[m]["exp_avg_sq"] / (1 - beta2**self.t)).sqrt() + self.eps
        size = self.lr * (abs_avg / (1 - beta1**self.t) / denom + self.wd * before.abs())
        out = 4 * ulp(m.detach(), torch.float32) + (32 + 8 * self.t) * U32 * size
        if self.rounding:
            out += ulp(m.detach(), torch.bfloat16) * (0.5 if self.rounding == "nearest" else 1.0)
        return out


def lockstep_run(config: dict, reference: dict, steps: int = 5, dpu_warmup: int | None = None,
                 reference_class=None) -> list[dict]:
    """Train the toy model with the engine on this rank's micro-batches, checking every step against a
    `Reference16` built from ``reference`` (its keyword arguments) that starts from the engine's masters.

    Before step u the engine's 16-bit weights must be the rounded masters the step's forward runs on: after u
    steps, or under the delayed parameter update (``dpu_warmup``) after u-1 once u > warmup.

    Returns, per step: ``weights_ulp`` (max ulps between the engine's 16-bit weights and the rounded masters
    they must be), ``masters_ratio`` (max over elements of |engine - reference| / bound), ``worst`` (the name
    where it is largest), ``norm_rel`` (relative difference of ``engine.last_grad_norm`` and
    ``clip_grad_norm_``'s) and the two losses.
    """
    import torch.distributed as dist

    import zero_offload

    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    engine = zero_offload.initialize(make_model(), config)
    ref = (reference_class or Reference16)(ws=ws, **reference)
    dtype = ref.dtype
    history = [engine.full_state_dict()]
    out = []
    for u in range(steps):
        use = history[-2] if dpu_warmup is not None and u >= dpu_warmup + 1 else history[-1]
        expected = {n: v.to(dtype) for n, v in use.items()}
        with zero_offload.gathered_parameters(engine.module.parameters()):
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        weights_ulp = max(((weights[n].float() - expected[n].float()).abs() / ulp(expected[n].float(), dtype))
                          .max().item() for n in expected)
        step = ref.step(u, history[-1], expected)
        loss = train_step(engine, u, rank, ws)
        masters = engine.full_state_dict()
        ratios = {n: ((masters[n] - step["masters"][n]).abs() / step["bound"][n]).max().item() for n in masters}
        worst = max(ratios, key=ratios.get)
        off16 = sum(int((v != v.bfloat16().float()).sum()) for v in masters.values())   # not bf16 values
        out.append({"weights_ulp": weights_ulp, "masters_ratio": ratios[worst], "worst": worst,
                    "masters_off_bf16": off16,
                    "norm_rel": abs(engine.last_grad_norm - step["norm"]) / step["norm"], "norm": step["norm"],
                    "loss": loss, "ref_loss": step["loss"]})
        history.append(masters)
    engine.close()        # its threads end here: a later run_ranks forks no thread holding a lock
    return out


def lockstep_runs(cases: list[tuple[dict, dict, int | None]], steps: int = 5) -> list[list[dict]]:
    """`lockstep_run` of every (config, reference kwargs, dpu_warmup) case, in order."""
    return [lockstep_run(config, ref, steps, dpu) for config, ref, dpu in cases]
