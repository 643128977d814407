"""Power tests: each fault a review found the suite blind to is injected (monkeypatched, one at a time) and the
matching exactness check of `test_exact16` must then fail. A fault no check catches is a missing test.

Faults are injected in the parent process; at 2 ranks the ranks are forked from it and inherit them. A run
that breaks outright under a fault fails its exactness test too, and is reported as such.
"""
from __future__ import annotations

import functools

import pytest

from test_exact16 import LOSS_SCALE, Case, check, run_cases
from zero_offload.engine import Engine
from zero_offload.hoststep.delayed import DelayedParamUpdate
from zero_offload.zero import ZeroOptimizer
from zero_offload.zero.averaging import GradAveraging
from zero_offload.zero.stage3 import Stage3Optimizer
from zero_offload.zero.stage3.lifecycle import UnitLifecycle
from zero_offload.hoststep.adam import PartitionedAdam
from zero_offload.hoststep.nvme_adam import NvmeAdam
from zero_offload.hoststep.speculation import SubGroupSpeculation
from zero_offload.hoststep.speculation import PieceSpeculation


def _wrap(monkeypatch, owner, name: str, make):
    """Replace ``owner.name`` by ``make(original)``."""
    monkeypatch.setattr(owner, name, functools.wraps(getattr(owner, name))(make(getattr(owner, name))))


def no_unscale(mp):
    """The optimizer steps gradients still multiplied by the fp16 loss scale."""
    for cls in (ZeroOptimizer, Stage3Optimizer):
        _wrap(mp, cls, "step", lambda f: lambda self, grad_scale: f(self, grad_scale * LOSS_SCALE))


def communication_dtype_ignored(mp):
    """Gradients are reduced in the training dtype whatever communication_data_type says."""
    mp.setattr("zero_offload.zero.zero_optimizer.communication_dtype", lambda config: None)
    mp.setattr("zero_offload.zero.stage3.optimizer.communication_dtype", lambda config: None)


def weight_decay_ignored(mp):
    def make(f):
        def groups(self, model_parameters):
            out = f(self, model_parameters)
            for g in out:
                g.hparams["weight_decay"] = 0.0
            return out
        return groups
    _wrap(mp, Engine, "_param_groups", make)


def sum_instead_of_average(mp):
    mp.setattr(GradAveraging, "before_sum", lambda self, buf, divide_first: None)
    mp.setattr(GradAveraging, "after_sum", lambda self, buf, divide_first: None)


def accumulation_not_divided(mp):
    _wrap(mp, Engine, "backward",
          lambda f: lambda self, loss, retain_graph=False: f(self, loss * self.gradient_accumulation_steps,
                                                              retain_graph))


def clipping_skipped(mp):
    def make(f):
        def init(self, *args, **kwargs):
            f(self, *args, **kwargs)
            self.config.gradient_clipping = 0.0
        return init
    _wrap(mp, Engine, "__init__", make)


def bucket_reduced_twice(mp):
    from zero_offload.comm import DistContext

    def make(f):
        def reduce(self, tensor, owner, async_op=True, average=False):
            f(self, tensor, owner, async_op=False, average=average)
            return f(self, tensor, owner, async_op=async_op, average=average)
        return reduce
    _wrap(mp, DistContext, "reduce", make)


def unit_released_before_backward(mp):
    """Backward runs on released units: neither the pre-backward hook nor a saved-tensor unpack gathers them."""
    from zero_offload.zero.stage3.saved_params import SavedParameterGuard

    mp.setattr(UnitLifecycle, "_pre_backward", lambda self, units, grad: grad)
    mp.setattr(SavedParameterGuard, "_unpack", lambda self, packed: packed[0])


def delayed_update_one_step_late(mp):
    """Every other finished host step is not copied up: the next forward runs a step behind the schedule."""
    def make(f):
        def flush(self):
            if self.unpublished:
                self.skip = not getattr(self, "skip", False)
                if self.skip:
                    self.wait()
                    self.unpublished = False
                    return
            f(self)
        return flush
    _wrap(mp, DelayedParamUpdate, "flush", make)


def speculation_kept_when_clipped(mp):
    """super_offload keeps the step speculated with clip coefficient 1 although clipping fired."""
    _wrap(mp, PieceSpeculation, "settle",
          lambda f: lambda self, grad_scale, grads: f(self, self.grad_scale, grads))


def correction_applied_twice(mp):
    """super_offload: where clipping fired, the step with the true coefficient runs twice."""
    def make(f):
        def host_step(self, grads, grad_scale, lrs):
            if self.speculation is not None:
                f(self, grads, grad_scale, lrs)
            return f(self, grads, grad_scale, lrs)
        return host_step
    _wrap(mp, PartitionedAdam, "_host_step", make)


def nvme_speculation_kept_when_clipped(mp):
    """super_offload over NVMe keeps the sub-groups speculated with clip coefficient 1 although clipping fired."""
    _wrap(mp, SubGroupSpeculation, "settle",
          lambda f: lambda self, grad_scale, grads, same_lrs=True: f(self, self.grad_scale, grads, same_lrs))


def nvme_correction_applied_twice(mp):
    """super_offload over NVMe: where clipping fired, the step with the true coefficient runs twice."""
    def make(f):
        def step(self, grads, grad_scale, lrs):
            if self.speculation is not None:
                f(self, grads, grad_scale, lrs)
            return f(self, grads, grad_scale, lrs)
        return step
    _wrap(mp, NvmeAdam, "_step", make)


def device_part_with_another_coefficient(mp):
    """offload_optimizer.ratio: the device part is stepped with the coefficient of an unclipped step."""
    from zero_offload.hoststep.split import SplitAdam

    def step(self, grads, grad_scale, lrs=None, publish=True):
        self.device.step([g.device for g in grads], grad_scale * 2.0, lrs)
        self.host.step([g.host for g in grads], grad_scale, lrs, publish)
    mp.setattr(SplitAdam, "step", step)


FAULTS = [
    (no_unscale, Case("fp16", 2, "cpu", 1, False), 1),
    (no_unscale, Case("fp16", 3, "none", 3, True), 1),
    (communication_dtype_ignored, Case("fp32", 2, "cpu", 1, False, comm="bf16"), 2),
    (communication_dtype_ignored, Case("bf16", 3, "cpu", 3, True, comm="fp32"), 2),
    (weight_decay_ignored, Case("bf16", 2, "cpu", 3, False), 1),
    (weight_decay_ignored, Case("fp16", 1, "none", 3, False), 1),
    (sum_instead_of_average, Case("bf16", 2, "cpu", 3, False), 2),
    (sum_instead_of_average, Case("fp16", 3, "none", 3, True), 2),
    (accumulation_not_divided, Case("bf16", 1, "none", 3, False), 1),
    (accumulation_not_divided, Case("fp16", 3, "cpu", 3, True, True), 1),
    (clipping_skipped, Case("bf16", 2, "nvme", 3, True), 1),
    (clipping_skipped, Case("fp16", 3, "cpu", 3, True, True), 1),
    (bucket_reduced_twice, Case("bf16", 2, "cpu", 3, False), 2),
    (unit_released_before_backward, Case("bf16", 3, "none", 3, True), 1),
    (delayed_update_one_step_late, Case("bf16", 2, "cpu", 1, True, True), 1),
    (delayed_update_one_step_late, Case("fp16", 3, "cpu", 3, True, True), 2),
    (speculation_kept_when_clipped, Case("bf16", 2, "cpu", 3, True, spec=True), 1),
    (speculation_kept_when_clipped, Case("fp16", 3, "cpu", 1, True, spec=True), 2),
    (correction_applied_twice, Case("bf16", 3, "cpu", 1, True, spec=True), 1),
    (correction_applied_twice, Case("fp16", 2, "cpu", 3, True, spec=True), 2),
    (nvme_speculation_kept_when_clipped, Case("bf16", 2, "nvme", 3, True, spec=True), 1),
    (nvme_speculation_kept_when_clipped, Case("fp16", 3, "nvme", 1, True, spec=True), 2),
    (nvme_correction_applied_twice, Case("bf16", 2, "nvme", 1, True, spec=True), 1),
    (device_part_with_another_coefficient, Case("bf16", 2, "cpu", 1, True, ratio=0.5), 1),
    (device_part_with_another_coefficient, Case("fp16", 3, "cpu", 3, True, ratio=0.5), 2),
]


def _failure(case: Case, ws: int, nvme_path: str) -> str | None:
    """Why the exactness check of ``case`` fails (None: it passes)."""
    try:
        steps = run_cases([case], ws, nvme_path)[0]
    except Exception as e:                   # the run itself broke
        return f"the run failed: {type(e).__name__}: {str(e)[-300:]}"
    try:
        check(steps)
    except AssertionError as e:
        return str(e)
    return None


@pytest.mark.parametrize("fault,case,ws", FAULTS, ids=[f"{f.__name__}-{c}-ws{w}" for f, c, w in FAULTS])
def test_fault_is_caught(monkeypatch, tmp_path, fault, case, ws):
    with monkeypatch.context() as mp:
        fault(mp)
        failure = _failure(case, ws, str(tmp_path))
    assert failure is not None, f"{fault.__name__} went unnoticed by {case} at {ws} rank(s)"
    print(f"{fault.__name__}: {failure.splitlines()[0]}")


def overflow_not_undone(mp):
    """super_offload: on fp16 overflow the speculated step is kept instead of dropped."""
    def discard(self):
        if self.active:
            self.join()
            self.active = False
            self.bank.keep()
            for master in self.masters:
                self.optimizer.count_step(master)
    mp.setattr(PieceSpeculation, "discard", discard)


def nvme_overflow_not_undone(mp):
    """super_offload over NVMe: on fp16 overflow the sub-groups speculated so far are kept instead of dropped."""
    def discard_speculation(self):
        spec = self.speculation
        if spec is not None and spec.active:
            spec.join()
            spec.active = False
            self._drain()
            for k in spec.stepped:
                self.bank[k] = 1 - self.bank[k]
    mp.setattr(NvmeAdam, "discard_speculation", discard_speculation)


@pytest.mark.parametrize("offload", ("cpu", "nvme"))
@pytest.mark.parametrize("stage", (2, 3))
def test_overflow_not_undone_is_caught(monkeypatch, tmp_path, stage, offload):
    from test_super_offload import test_fp16_overflow_is_undone
    with monkeypatch.context() as mp:
        (overflow_not_undone if offload == "cpu" else nvme_overflow_not_undone)(mp)
        with pytest.raises(AssertionError):
            test_fp16_overflow_is_undone(stage, offload, tmp_path)
