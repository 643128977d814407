"""The next forward waits for each module's own updated parameters (issue 27, item 3; `zero_offload.zero.copy_in`).

Under ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` every copy up lands 50 ms after it is queued (a fixed delay here, so a
read that does not wait sees the old value every time), and a compute-stream wait blocks until its copy ran:

- the first module's pre-hook waits for the chunks of its own parameters only: copies stay pending after it;
- a run with the per-module waits ends bitwise equal to the same run that waits for every copy after each step,
  with and without the delayed update;
- reading the parameters right after ``engine.step()`` (an EMA update) sees the updated values, and without the
  guard it does not (the power check);
- a parent that reads a child's weight without calling the child is caught in the first forward: a warning
  names the parameter, every later step waits for all, and the run stays exact.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import zero_offload
from toy_model import batch, make_model
from zero_offload.offload import simulated
from zero_offload.zero import copy_in, partitioned_adam

STEPS = 3


@pytest.fixture
def slow_copies(monkeypatch):
    """Simulated streams, each copy landing 50 ms after it is queued, and copies up of 512 elements."""
    monkeypatch.setenv(simulated.ENV, "1")
    monkeypatch.setenv(copy_in.ENV, "1")
    monkeypatch.delenv(simulated.SKIP_WAITS_ENV, raising=False)
    monkeypatch.setattr(simulated, "random_delay", lambda: 0.05)
    monkeypatch.setattr(partitioned_adam, "COPY_CHUNK", 512)


def config(dpu: bool = False, precision: str = "bf16") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": dpu,
                                                                   "dpu_warmup_steps": 1}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, steps: int = STEPS, after_step=None) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = batch(step, 4)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if after_step is not None:
            after_step(engine)
    return losses


def final(engine, model) -> dict:
    engine.flush_delayed_update()
    out = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    return out


def test_the_first_module_waits_for_its_own_chunks_only(slow_copies):
    """(The delayed update leaves no copy up pending at all: its step lands the chunks in device buffers while
    it runs, and publishing is a device-side copy: `test_delayed_update`.)"""
    model = make_model()
    engine = zero_offload.initialize(model, config())
    assert engine.zero.copy_in is not None
    train(engine, 1)
    adam = engine.zero.adam
    assert adam.pending_copies_up() and len(adam.up.pending) > 4
    seen = []
    original = adam.wait_copies_up

    def spy(needs=None):
        original(needs)
        seen.append((needs, len(adam.up.pending)))
    adam.wait_copies_up = spy
    x, y = batch(1, 4)
    engine(x, y)
    first_needs, left = seen[0]
    wte = model.wte.weight.numel()          # the first module: the embedding, at the front of the flat buffer
    assert first_needs == {0: wte} and left > 0, seen[:3]
    engine.close()


@pytest.mark.parametrize("dpu", [False, True])
def test_per_module_waits_change_no_bit(slow_copies, monkeypatch, dpu):
    model = make_model()
    engine = zero_offload.initialize(model, config(dpu))
    lazy = train(engine), final(engine, model)
    monkeypatch.setattr(copy_in.CopyInWaits, "after_step", lambda self: self.wait_all())
    model = make_model()
    engine = zero_offload.initialize(model, config(dpu))
    eager = train(engine), final(engine, model)
    assert lazy[0] == eager[0]
    for name, value in eager[1].items():
        assert torch.equal(lazy[1][name], value), name


def _ema_reads(engine, model) -> list[bool]:
    """After each step: do the parameters read at once equal the masters the step wrote?"""
    masters = engine.zero.adam.masters[0]
    flat = engine.zero.flats[0]
    agree = []

    def read(_engine):
        now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])   # a torch function: guarded
        expected = masters[:flat.numel].to(now.dtype)
        agree.append(torch.equal(now[:flat.numel], expected[:now.numel()]))
    train(engine, STEPS, read)
    engine.close()
    return agree


def test_a_read_right_after_the_step_sees_the_update(slow_copies, monkeypatch):
    from torch.overrides import _get_current_function_mode_stack
    model = make_model()
    engine = zero_offload.initialize(model, config(precision="bf16"))
    assert _ema_reads(engine, model) == [True] * STEPS
    # each guard left the mode stack (one triggered inside its own handler is removed at the next forward, or at
    # close): none piles up, step after step, under every torch call
    assert _get_current_function_mode_stack() == []
    # power: without the guard between the step and the forward, the same read sees the old values
    monkeypatch.setattr(copy_in.CopyInWaits, "_push", lambda self, mode: None)
    model = make_model()
    engine = zero_offload.initialize(model, config(precision="bf16"))
    assert _ema_reads(engine, model) == [False] * STEPS


class ReadsChildWeight(torch.nn.Module):
    """A parent that multiplies by its child's weight without calling the child."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 16)
        self.child = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        h = F.linear(self.first(x), self.child.weight)   # child.forward never runs: its hook never fires
        return F.mse_loss(h, y)


def _run_reads_child(steps: int = STEPS):
    model = ReadsChildWeight()
    engine = zero_offload.initialize(model, config(precision="fp32"))
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return engine, final(engine, model)


def test_a_parameter_read_outside_its_module_turns_the_waits_off(slow_copies, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, lazy = _run_reads_child()
    assert not engine.zero.copy_in.enabled
    messages = [str(w.message) for w in caught if "read before the forward" in str(w.message)]
    assert len(messages) == 1 and "child.weight" in messages[0]
    monkeypatch.setattr(copy_in.CopyInWaits, "after_step", lambda self: self.wait_all())
    _, eager = _run_reads_child()
    for name, value in eager.items():
        assert torch.equal(lazy[name], value), name


def test_no_per_module_waits_where_an_all_gather_follows_or_without_offload(monkeypatch):
    monkeypatch.setenv(copy_in.ENV, "1")
    model = make_model()
    plain = zero_offload.initialize(model, {**config(), "zero_optimization": {"stage": 2}})
    assert plain.zero.copy_in is None
    plain.close()
    compiled = make_model()
    compiled.blocks[0].compile()
    engine = zero_offload.initialize(compiled, config())
    assert engine.zero.copy_in is None          # hooks inside dynamo's frames would break its graphs
    engine.close()
    monkeypatch.delenv(copy_in.ENV)              # opt-in: off by default
    engine = zero_offload.initialize(make_model(), config())
    assert engine.zero.copy_in is None
    engine.close()


def test_the_delayed_step_does_not_wait_for_the_copies_publishing_the_step_before(slow_copies, monkeypatch):
    """The delayed update's host step writes over the gradient buffer it reads; the copies up that publish the
    step before read the other buffer. Its thread must not block on them (it did, 0.37 s per step at 10B on an
    H200, which the next boundary then waited for)."""
    import threading
    ups, blocked = set(), []
    to_device, synchronize = simulated.SimulatedCopies.to_device, simulated.SimulatedHandle.synchronize

    def spy_to_device(self, dst, src, after=None):
        handle = to_device(self, dst, src, after)
        ups.add(id(handle))
        return handle

    def spy_synchronize(self):
        if id(self) in ups and not self.query():
            blocked.append(threading.current_thread().name)
        synchronize(self)
    monkeypatch.setattr(simulated.SimulatedCopies, "to_device", spy_to_device)
    monkeypatch.setattr(simulated.SimulatedHandle, "synchronize", spy_synchronize)
    model = make_model()
    engine = zero_offload.initialize(model, config(dpu=True))
    train(engine, 4)
    engine.close()
    assert ups and not [name for name in blocked if "dpu" in name.lower()], blocked


def test_a_load_right_after_a_step_is_not_overwritten_by_its_copies_up(slow_copies):
    """Loading optimizer state while the last step's copies up are still queued: they are waited for first, so
    they cannot land over the parameters the load writes (through the optimizer: no parameter read to guard)."""
    import copy
    model = make_model()
    engine = zero_offload.initialize(model, config())
    train(engine, 1)
    engine.zero.copy_in.wait_all()
    saved_state = copy.deepcopy(engine.zero.state_dict())
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(engine, 1)                       # its copies up land 50 ms later
    engine.zero.load_state_dict(saved_state)
    engine.zero.copy_in.wait_all()
    for name, value in saved.items():
        assert torch.equal(dict(model.named_parameters())[name].detach(), value), name
    engine.close()


def test_a_model_compiled_after_initialize_waits_for_the_whole_copy(slow_copies):
    """``model.compile()`` after ``initialize``: dynamo would trace the hooks and the guard's mode (recompiling
    each step); from the first step after it, every step waits for its whole copy up instead."""
    model = make_model()
    engine = zero_offload.initialize(model, config())
    train(engine, 1)
    assert engine.zero.copy_in.enabled
    model.compile()
    train(engine, 2)
    assert not engine.zero.copy_in.enabled and not engine.zero.adam.pending_copies_up()
    engine.close()
    torch._dynamo.reset()       # drop the compiled graphs and their fake tensors: later tests count live tensors
