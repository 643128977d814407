"""bf16 and fp16 training is exact against a plain-torch 16-bit reference, step by step (`reference16`).

Every step of every case below is checked three ways against `reference16.Reference16` started from the
engine's own masters:
- the engine's 16-bit weights before the step are exactly the rounded masters the step must run on (after the
  previous step; under the delayed parameter update, after the one before);
- the engine's fp32 masters after the step are within the derived per-element bound of `reference16` (a few
  ulp of the master and of its update);
- ``engine.last_grad_norm`` is within ``NORM_REL`` of what ``torch.nn.utils.clip_grad_norm_`` returns.

The matrix covers stages 0-3, offload none/cpu/nvme (at stage 3 the parameters too, every unit released after
use), the delayed parameter update, ``super_offload`` (the speculated step kept without clipping and redone under
it: the same bound, since the masters are the plain kernel's result on the same inputs either way),
``offload_optimizer.ratio`` 0.5 (the device part's masters within the same bound), both also with the states on
NVMe, the gradient partition kept on the device (``gradients_on_device``), accumulation 1 and 3, clipping on and
off, at 1 and 2 ranks, for bf16 and fp16 (a static loss scale of 2**8), plus communication_data_type cases.
AdamW's eps is 1e-4, of the order of the gradients' root mean square: with eps far below it Adam is invariant to
the gradient's scale, and a gradient stepped 256 times too large (no unscale) would change nothing visible.
Weight decay is 0.1 so that dropping it moves a master by lr x 0.1 x |w| per step, hundreds of ulp.
"""
from __future__ import annotations

from typing import NamedTuple

import pytest

from dist_utils import run_ranks
from reference import engine_config
from reference16 import lockstep_runs

STEPS, EPS, WD, CLIP, LOSS_SCALE, DPU_WARMUP = 5, 1e-4, 0.1, 0.05, 2.0**8, 1
# Both norms sum < 2**15 fp32 squares, in different groupings (flat partitions, all-reduced, against
# torch's per-tensor norms): measured <= 1.2e-6 relative on AVX2 and AVX-512 hosts; bound with 8x margin.
NORM_REL = 1e-5
LOSS_REL = 2e-6   # the same forward; fp32 sums of micro-batch losses against Python's double sum


class Case(NamedTuple):
    precision: str
    stage: int
    offload: str
    gas: int
    clip: bool
    dpu: bool = False
    comm: str | None = None
    spec: bool = False           # offload_optimizer.super_offload
    ratio: float = 1.0           # offload_optimizer.ratio: the share offloaded
    on_device: bool = False      # offload_optimizer.gradients_on_device

    def __str__(self) -> str:
        return (f"{self.precision}-stage{self.stage}-{self.offload}-gas{self.gas}" + ("-clip" if self.clip else "")
                + ("-dpu" if self.dpu else "") + (f"-comm_{self.comm}" if self.comm else "")
                + ("-super_offload" if self.spec else "") + (f"-ratio{self.ratio}" if self.ratio < 1 else "")
                + ("-grads_on_device" if self.on_device else ""))


SHAPES = [(0, "none", 1, False, False), (0, "none", 3, True, False), (1, "none", 3, False, False),
          (1, "cpu", 1, True, False), (2, "none", 1, True, False), (2, "cpu", 3, False, False),
          (2, "cpu", 1, True, True), (2, "nvme", 3, True, False), (3, "none", 3, True, False),
          (3, "cpu", 1, False, False), (3, "cpu", 3, True, True), (3, "nvme", 1, True, False)]
CASES = [Case(p, *shape) for p in ("bf16", "fp16") for shape in SHAPES]
# super_offload: the speculated step stands (no clipping) or is redone (every step clipped here); its bound is the
# plain step's, since either way the masters are the plain kernel's result on the same inputs.
SPEC_SHAPES = [(2, "cpu", 1, False), (2, "cpu", 3, True), (3, "cpu", 1, True), (3, "cpu", 3, False)]
CASES += [Case(p, *shape, spec=True) for p in ("bf16", "fp16") for shape in SPEC_SHAPES]
# ... and over NVMe states, sub-group by sub-group into a second bank of swap files.
CASES += [Case(p, stage, "nvme", gas, clip, spec=True) for p in ("bf16", "fp16")
          for stage, gas, clip in ((2, 3, True), (3, 1, False), (2, 1, False))]
# ratio < 1: the device part's masters and moments stepped where the parameters are, under the same bound.
RATIO_SHAPES = [(2, 1, True, False), (2, 3, False, True), (3, 3, True, False)]     # stage, gas, clip, super_offload
CASES += [Case(p, stage, "cpu", gas, clip, ratio=0.5, spec=spec) for p in ("bf16", "fp16")
          for stage, gas, clip, spec in RATIO_SHAPES]
# ... and with the host part's states in NVMe swap files.
CASES += [Case(p, stage, "nvme", gas, clip, ratio=0.5) for p in ("bf16", "fp16")
          for stage, gas, clip in ((2, 3, True), (3, 1, False))]
# gradients kept on the device, pulled down chunk by chunk by the host step (at stage 3 with the parameters on
# the host: the kernel writes them in place).
CASES += [Case(p, stage, "cpu", gas, clip, on_device=True) for p in ("bf16", "fp16")
          for stage, gas, clip in ((1, 3, True), (2, 1, False), (2, 3, True), (3, 3, False))]
# communication_data_type shows only where a sum is not rounded back to the training dtype anyway: bf16
# reductions of fp32 training, and fp32 reductions into stage 3's fp32 accumulation.
COMM_CASES = [Case("fp32", 2, "cpu", 1, False, comm="bf16"), Case("bf16", 3, "cpu", 3, True, comm="fp32"),
              Case("fp16", 3, "none", 3, False, comm="fp32")]


def case_config(case: Case, ws: int, nvme_path: str) -> dict:
    cfg = engine_config(case.stage, case.offload, case.gas, clip=CLIP if case.clip else 0.0,
                        precision=case.precision, ws=ws, wd=WD, eps=EPS)
    zero = cfg["zero_optimization"]
    if case.precision == "fp16":
        cfg["fp16"]["loss_scale"] = LOSS_SCALE
    if case.comm:
        cfg["communication_data_type"] = case.comm
    if case.stage == 3:   # every unit released after use and gathered again, prefetched a few units ahead
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                    stage3_prefetch_bucket_size=3000)
    if case.stage == 3 and case.offload != "none" and case.ratio == 1:    # ratio < 1 steps device parameters
        params = "cpu" if case.spec else case.offload                     # super_offload: parameters in memory
        zero["offload_param"] = {"device": params, **({"nvme_path": nvme_path, "buffer_count": 3,
                                                       "buffer_size": 10_000} if params == "nvme" else {})}
    if case.offload == "nvme":
        zero["offload_optimizer"].update(nvme_path=nvme_path, buffer_count=3)
        zero["sub_group_size"] = 3000
        cfg["aio"] = {"block_size": 8192}
    if case.dpu:
        zero["offload_optimizer"].update(delayed_param_update=True, dpu_warmup_steps=DPU_WARMUP)
    if case.spec:
        zero["offload_optimizer"]["super_offload"] = True
    if case.ratio < 1:
        zero["offload_optimizer"]["ratio"] = case.ratio
    if case.on_device:     # chunks of 700 elements: several per step, so the stream's slots are reused
        zero["offload_optimizer"].update(gradients_on_device=True, copy_chunk=700)
    return cfg


def reference_kwargs(case: Case) -> dict:
    return dict(precision=case.precision, stage=case.stage, gas=case.gas, clip=CLIP if case.clip else 0.0,
                loss_scale=LOSS_SCALE if case.precision == "fp16" else 1.0, comm=case.comm, weight_decay=WD,
                eps=EPS)


def run_cases(cases: list[Case], ws: int, nvme_path: str) -> list[list[dict]]:
    """Lockstep runs of ``cases`` at world size ``ws`` (rank 0's view at 2 ranks)."""
    args = [(case_config(c, ws, nvme_path), reference_kwargs(c), DPU_WARMUP if c.dpu else None) for c in cases]
    return lockstep_runs(args, STEPS) if ws == 1 else run_ranks(lockstep_runs, 2, args, STEPS)[0]


def check(steps: list[dict]) -> None:
    """Assert every step of one lockstep run is within the stated bounds."""
    for u, s in enumerate(steps):
        assert s["weights_ulp"] == 0, f"step {u}: 16-bit weights {s['weights_ulp']:.0f} ulp off the rounded masters"
        assert s["masters_ratio"] <= 1.0, \
            f"step {u}: masters off by {s['masters_ratio']:.3g} x the bound (at {s['worst']})"
        assert s["norm_rel"] <= NORM_REL, f"step {u}: gradient norm off by {s['norm_rel']:.2e} relative"
        assert abs(s["loss"] - s["ref_loss"]) <= LOSS_REL * abs(s["ref_loss"]), f"step {u}: loss {s}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme16"))
    out = {}
    for ws in (1, 2):
        cases = CASES + (COMM_CASES if ws == 2 else [])
        out.update({(ws, c): r for c, r in zip(cases, run_cases(cases, ws, path))})
    return out


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_16bit_steps_match_the_reference(results, ws, case):
    check(results[(ws, case)])


@pytest.mark.parametrize("case", COMM_CASES, ids=str)
def test_communication_dtype_steps_match_the_reference(results, case):
    check(results[(2, case)])


def test_clipping_engages(results):
    """The clip cases really clip: the gradient norm exceeds ``gradient_clipping`` at every step."""
    for (ws, case), steps in results.items():
        if case.clip:
            assert all(s["norm"] > 2 * CLIP for s in steps), (ws, case)
