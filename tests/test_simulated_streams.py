"""Stream ordering checked on the CPU (issue 20, section 2): with ``ZERO_OFFLOAD_SIMULATE_STREAMS=1`` every
asynchronous copy, collective and NVMe request lands later, on a worker thread (`zero_offload.offload.simulated`).

- bf16 runs with gradient accumulation 2 (and 1) of ZeRO-2 + offload, ZeRO-2 + offload + the delayed parameter update
  or super_offload,
  stage 3 with the optimizer and the parameters offloaded (one rank, and two ranks, where the gathers and
  reduce-scatters are simulated collectives) and NVMe offload end **bitwise** equal with and without the
  simulation: masters, 16-bit weights, every step's loss and gradient norm;
- the same runs with every wait skipped (``ZERO_OFFLOAD_SIMULATE_STREAMS_SKIP_WAITS=1``) differ: the simulation
  sees a missing wait (without this the first check would prove nothing);
- one wait taken out at a time (a copy's event, a slot's reuse, a collective, an NVMe request) is seen too;
- the exactness matrix of `test_exact16` (its cases with copies in flight: every offloaded case, and stage 3 at
  two ranks) holds under the simulation against the 16-bit reference.
"""
from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_ranks
from reference import engine_run
from reference16 import lockstep_runs
from test_exact16 import DPU_WARMUP, STEPS, Case, case_config, check, reference_kwargs
from zero_offload.offload import simulated, staging_ring

MODES = {"off": {}, "sim": {simulated.ENV: "1"}, "skip": {simulated.ENV: "1", simulated.SKIP_WAITS_ENV: "1"}}

# bf16, gradient accumulation 2 (and one case of 1: its buckets go down straight, not throttled by the staging
# slots): (name, case, world size)
RUNS = [("zero2-offload", Case("bf16", 2, "cpu", 2, True), 1),
        ("zero2-offload-gas1", Case("bf16", 2, "cpu", 1, True), 1),
        ("zero2-offload-dpu", Case("bf16", 2, "cpu", 2, True, dpu=True), 1),
        ("zero3-offload-params", Case("bf16", 3, "cpu", 2, True), 1),
        ("zero3-offload-params-2ranks", Case("bf16", 3, "cpu", 2, True), 2),
        ("zero2-nvme", Case("bf16", 2, "nvme", 2, True), 1),
        ("zero3-nvme-params", Case("bf16", 3, "nvme", 2, True), 1),
        ("zero2-offload-super", Case("bf16", 2, "cpu", 1, False, spec=True), 1),
        ("zero2-offload-super-fp32", Case("fp32", 2, "cpu", 1, False, spec=True), 1),
        ("zero2-offload-super-gas2", Case("bf16", 2, "cpu", 2, False, spec=True), 1),
        ("zero3-offload-params-super-2ranks", Case("bf16", 3, "cpu", 2, False, spec=True), 2),
        ("zero2-offload-ratio-super", Case("bf16", 2, "cpu", 1, False, spec=True, ratio=0.5), 1),
        ("zero3-offload-ratio-2ranks", Case("bf16", 3, "cpu", 2, True, ratio=0.5), 2),
        ("zero2-nvme-ratio", Case("bf16", 2, "nvme", 2, True, ratio=0.5), 1),
        ("zero2-nvme-super", Case("bf16", 2, "nvme", 1, False, spec=True), 1),
        ("zero3-nvme-super-gas2", Case("bf16", 3, "nvme", 2, False, spec=True), 1),
        ("zero2-offload-grads-on-device", Case("bf16", 2, "cpu", 1, True, on_device=True), 1),
        ("zero2-offload-grads-on-device-gas2", Case("bf16", 2, "cpu", 2, False, on_device=True), 1)]


def in_mode(mode: str, fn, *args):
    """``fn(*args)`` with the simulation's variables set as ``mode`` says (restored after)."""
    saved = {k: os.environ.pop(k, None) for k in (simulated.ENV, simulated.SKIP_WAITS_ENV)}
    os.environ.update(MODES[mode])
    try:
        return fn(*args)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def summary(config: dict) -> dict:
    """What one run ends with: fp32 masters, 16-bit weights, per-step losses and gradient norms."""
    masters, params, losses, norms = engine_run(config, STEPS, with_norms=True)
    return {"masters": masters, "params": params, "losses": losses, "norms": norms}


def run_in_mode(mode: str, config: dict, ws: int) -> dict:
    if ws == 1:
        return in_mode(mode, summary, config)
    return run_ranks(in_mode, ws, mode, summary, config)[0]


def differences(a: dict, b: dict) -> list[str]:
    """What differs, bitwise, between two run summaries."""
    out = [f"{kind}.{n}" for kind in ("masters", "params") for n in a[kind]
           if not torch.equal(a[kind][n], b[kind][n])]
    return out + [k for k in ("losses", "norms") if a[k] != b[k]]


# Updated parameters pass through the staging ring in slots this small, so that its slots are reused within a
# step (the toy model's partition would fit one default slot, and the ring's own wait would never matter).
RING_SLOT = 1024


@pytest.fixture(autouse=True)
def small_ring_slots(monkeypatch):
    monkeypatch.setattr(staging_ring, "SLOT_NUMEL", RING_SLOT)


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staging_ring, "SLOT_NUMEL", RING_SLOT)
        for name, case, ws in RUNS:
            config = case_config(case, ws, str(tmp_path_factory.mktemp(f"nvme-{name}")))
            out[name] = {mode: run_in_mode(mode, config, ws) for mode in MODES}
    return out


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_simulated_streams_change_nothing(summaries, name):
    runs = summaries[name]
    assert differences(runs["off"], runs["sim"]) == []


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_skipped_waits_are_seen(summaries, name):
    runs = summaries[name]
    assert differences(runs["off"], runs["skip"]), "skipping every wait changed nothing: the simulation is blind"


def test_simulation_delays_work(tmp_path):
    """The simulated runs really went through the delayed paths: copies, collectives and NVMe pieces."""
    before = simulated.counts()
    in_mode("sim", summary, case_config(Case("bf16", 2, "nvme", 2, True), 1, str(tmp_path)))
    after = simulated.counts()
    assert after.copies > before.copies and after.collectives > before.collectives and after.io > before.io


# test_exact16's cases that have work in flight: every offloaded case (copies down and up, NVMe requests), and
# at two ranks the stage-3 cases too (gathers and reduce-scatters are then simulated collectives).
SIM_EXACT = [(c, 1) for c in (Case(p, 2, "cpu", 3, False) for p in ("bf16", "fp16"))] + \
    [(Case("bf16", *s), ws) for ws in (1, 2) for s in
     [(1, "cpu", 1, True, False), (2, "cpu", 1, True, True), (2, "nvme", 3, True, False),
      (3, "cpu", 3, True, True), (3, "nvme", 1, True, False)]] + [(Case("fp16", 3, "none", 3, True), 2)] + \
    [(Case(p, *s, spec=True), ws) for p in ("bf16", "fp16") for ws in (1, 2) for s in
     [(2, "cpu", 1, False), (2, "cpu", 3, True), (3, "cpu", 3, False), (3, "cpu", 1, True)]]


def test_exactness_matrix_under_simulation(tmp_path):
    path = str(tmp_path)
    for ws in (1, 2):
        cases = [c for c, w in SIM_EXACT if w == ws]
        args = [(case_config(c, ws, path), reference_kwargs(c), DPU_WARMUP if c.dpu else None) for c in cases]
        results = (in_mode("sim", lockstep_runs, args, STEPS) if ws == 1
                   else run_ranks(in_mode, 2, "sim", lockstep_runs, args, STEPS)[0])
        for case, steps in zip(cases, results):
            try:
                check(steps)
            except AssertionError as e:
                raise AssertionError(f"{case} at {ws} rank(s) under simulated streams: {e}") from None


# -- one missing wait at a time -------------------------------------------------------------------------------
# Each fault drops one kind of wait (monkeypatched in this process; forked ranks inherit it); the run under the
# simulation must then differ from the run without it. Skipping every wait at once (above) could hide that
# some single wait is never exercised.

def bucket_reused_before_its_copy(mp):
    """A stage-2 bucket is handed out again while its copy down still reads it (the bug the simulation found:
    the CPU pool reused buckets at once)."""
    from zero_offload.zero.bucket_pool import BucketPool
    release = BucketPool.release
    mp.setattr(BucketPool, "release", lambda self, view, reading=None: release(self, view))   # as if read


def partition_read_before_its_copies(mp):
    """The boundary reads the gradient partition without waiting for the copies down into it, nor for the
    staging worker's adds (under accumulation every piece goes through it)."""
    from zero_offload.zero.grad_partition import GradPartition
    mp.setattr(GradPartition, "finalize", lambda self: self.pending.clear())
    mp.setattr(GradPartition, "ready", lambda self: self.buffer)


def staged_piece_added_before_its_copy(mp):
    """The staging worker adds a staged piece into the partition without waiting for its copy down."""
    import threading
    real = simulated.SimulatedHandle.synchronize

    def synchronize(self):
        if not threading.current_thread().name.startswith("zero_offload-grad-staging"):
            real(self)
    mp.setattr(simulated.SimulatedHandle, "synchronize", synchronize)


def compute_does_not_wait_for_copies_up(mp):
    """The compute stream (the host here) does not wait for the updated parameters' copies up."""
    mp.setattr(simulated.SimulatedHandle, "wait_stream", lambda self, stream=None: None)


def ring_slot_rewritten_in_flight(mp):
    """A staging-ring slot is rewritten while its previous copy up still reads it."""
    from zero_offload.offload.staging_ring import StagingRing

    def copy_up(self, dst, src, after=None):      # StagingRing.copy_up without its wait on the slot's previous copy
        for lo in range(0, src.numel(), self.slot_numel):
            hi = min(src.numel(), lo + self.slot_numel)
            i, self.next = self.next, (self.next + 1) % len(self.slots)
            self.slots[i][:hi - lo].copy_(src[lo:hi])
            self.handles[i] = self.last = self.copies.to_device(dst[lo:hi], self.slots[i][:hi - lo], after)
        return self.last
    mp.setattr(StagingRing, "copy_up", copy_up)


def collective_not_waited(mp):
    """A reduce-scatter's or gather's result is read without waiting for the collective. As under skipped waits,
    the result then never lands: landing late, it could write into a gather buffer already freed (a crash of the
    rank, 1 run in 6, instead of a difference)."""
    mp.setattr(simulated.SimulatedWork, "wait", lambda self: True)
    init = simulated.SimulatedCollectives.__init__

    def never_lands(self):
        init(self)
        self.lands = False
    mp.setattr(simulated.SimulatedCollectives, "__init__", never_lands)


def speculation_before_its_copy(mp):
    """super_offload steps a gradient piece without waiting for its copy down."""
    from zero_offload.hoststep.speculation import PieceSpeculation
    submit = PieceSpeculation.submit
    mp.setattr(PieceSpeculation, "submit", lambda self, g, lo, values, copy: submit(self, g, lo, values, None))


def nvme_request_not_waited(mp):
    """An NVMe read or write is taken as done without waiting for it."""
    from zero_offload.nvme.swapper import Swapper

    def wait(self, pending):
        if pending in self.pending:
            self.pending.remove(pending)
    mp.setattr(Swapper, "wait", wait)


def streamed_chunk_read_before_its_copy(mp):
    """The host step reads a gradient chunk kept on the device before its copy down has landed."""
    from zero_offload.hoststep import grad_stream

    def fetch(self, g, _param, lo, hi):          # GradStream.fetch without its wait on the chunk's copy
        k = self.position[g, lo]
        self._issue_through(k + grad_stream.AHEAD)
        slot = self.slots[k % grad_stream.SLOTS][:hi - lo]
        return slot, (slot if self.over_slot[g] else None)
    mp.setattr(grad_stream.GradStream, "fetch", fetch)


def streamed_slot_refilled_before_its_copy_up(mp):
    """A gradient chunk is copied down into a slot whose parameters are still being copied up."""
    from zero_offload.hoststep.grad_stream import GradStream
    mp.setattr(GradStream, "copy_up", lambda self, dst, g, lo, after: _copy_up_unordered(self, dst, g, lo, after))


def _copy_up_unordered(stream, dst, g, lo, after):
    """`GradStream.copy_up` that tells the next copy down into the slot nothing to wait for."""
    from zero_offload.hoststep.grad_stream import SLOTS
    from zero_offload.offload.copies import DONE
    k = stream.position[g, lo]
    handle = stream.copies.to_device(dst, stream.slots[k % SLOTS][:dst.numel()], after)
    stream.reader_handles[k] = DONE
    stream.readers[k].set()
    return handle


# One rank's reductions complete at launch, as on a GPU: under accumulation the staging slots then hold the backward
# back until each bucket's copy has landed, and a bucket reused early is seen only where buckets go down straight.
FAULTS = [(bucket_reused_before_its_copy, "zero2-offload-gas1"), (partition_read_before_its_copies, "zero2-offload"),
          (staged_piece_added_before_its_copy, "zero2-offload"),
          (compute_does_not_wait_for_copies_up, "zero2-offload-dpu"), (ring_slot_rewritten_in_flight, "zero2-offload"),
          (collective_not_waited, "zero3-offload-params-2ranks"), (nvme_request_not_waited, "zero2-nvme"),
          (speculation_before_its_copy, "zero2-offload-super"),
          (streamed_chunk_read_before_its_copy, "zero2-offload-grads-on-device"),
          (streamed_slot_refilled_before_its_copy_up, "zero2-offload-grads-on-device")]


@pytest.mark.parametrize("fault,name", FAULTS, ids=[f.__name__ for f, _ in FAULTS])
def test_one_missing_wait_is_seen(summaries, monkeypatch, tmp_path, fault, name):
    case, ws = next((c, w) for n, c, w in RUNS if n == name)
    fault(monkeypatch)
    # Every transfer lands the longest delay late: with random delays a read that skips its wait may still come
    # after the landing by chance at every step (1 run in 6 here), and the fault would go unseen.
    monkeypatch.setattr(simulated, "random_delay", lambda: 2 * simulated.MAX_DELAY_S)
    faulty = run_in_mode("sim", case_config(case, ws, str(tmp_path)), ws)
    assert differences(summaries[name]["off"], faulty), f"{fault.__name__} went unseen in {name}"


# -- pools sized once ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", (2, 3))
def test_gradient_staging_and_buckets_never_grow(stage):
    """Under gradient accumulation 2 with copies in flight (simulated), the pinned gradient staging and the
    stage-2 bucket pool hold after the first step what they hold after five, and the memory model counts the
    staging exactly (`estimate_memory`'s ``grad_staging``)."""
    import zero_offload
    from reference import train_step
    from toy_model import make_model
    from zero_offload.estimate import estimate_memory

    config = case_config(Case("bf16", stage, "cpu", 2, True), 1, "")

    def run():
        engine = zero_offload.initialize(make_model(), config)
        seen = []
        for step in range(STEPS):
            train_step(engine, step, 0, 1)
            mem = engine.memory_breakdown()
            seen.append((mem["grad_staging"]["bytes"], mem.get("buckets", {}).get("bytes", 0)))
        return seen
    seen = in_mode("sim", run)
    assert seen[0][0] > 0 and all(s == seen[0] for s in seen), seen
    assert estimate_memory(make_model(), config, 1, accelerator=False).host["grad_staging"] == seen[0][0]
