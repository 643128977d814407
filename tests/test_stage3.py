"""ZeRO stage 3: partitioned parameters against plain-PyTorch AdamW, memory, and the awkward cases."""
import contextlib
import itertools
import warnings

import pytest
import torch
import torch.distributed as dist

import zero_offload
from dist_utils import run_ranks
from reference import MICRO, assert_norms_match, engine_config, engine_runs, reference_run
from toy_model import ToyTransformer, batch, make_model
from zero_offload.zero.stage3.units import ShardedUnit

OFFLOADS = {"none": ("none", "none"), "param": ("none", "cpu"), "optimizer": ("cpu", "none"),
            "both": ("cpu", "cpu")}
CASES = list(itertools.product(OFFLOADS, (1, 3)))
ATOL = 1e-5


def stage3_config(offload="none", gas=1, precision="fp32", ws=1, **zero):
    opt, param = OFFLOADS[offload]
    cfg = engine_config(3, opt, gas, precision=precision, ws=ws)
    cfg["zero_optimization"].update(offload_param={"device": param}, stage3_param_persistence_threshold=100,
                                    stage3_prefetch_bucket_size=3000, **zero)
    return cfg


@pytest.fixture(scope="module")
def fp32_results():
    out = {}
    for ws in (1, 2):
        configs = [stage3_config(o, g, ws=ws) for o, g in CASES]
        res = engine_runs(configs) if ws == 1 else run_ranks(engine_runs, 2, configs)[0]
        out.update({(ws, *c): r for c, r in zip(CASES, res)})
    return out


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("offload,gas", CASES)
def test_fp32_matches_adamw(fp32_results, ws, offload, gas):
    ref, ref_losses = reference_run(gas=gas, ws=ws)
    masters, params, losses = fp32_results[(ws, offload, gas)]
    for name, r in ref.items():
        assert (masters[name] - r).abs().max().item() <= ATOL, name
        assert (params[name] - r).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-5)


CLIP_CASES = [("both", 3), ("none", 1)]
CLIP = 1.0   # the global norm here is ~10: every step is clipped (test_engine_fp32.test_clipping_is_active)


@pytest.mark.parametrize("ws", (1, 2))
def test_fp32_clipping_matches_adamw(ws):
    """Clipped stage-3 steps equal clip_grad_norm_ + AdamW, and the global norm equals clip_grad_norm_'s."""
    configs = [stage3_config(o, g, ws=ws) for o, g in CLIP_CASES]
    for cfg in configs:
        cfg["gradient_clipping"] = CLIP
    res = engine_runs(configs, with_norms=True) if ws == 1 else run_ranks(engine_runs, 2, configs, 5, True)[0]
    for (offload, gas), (masters, params, losses, norms) in zip(CLIP_CASES, res):
        ref, ref_losses, ref_norms = reference_run(gas=gas, clip=CLIP, ws=ws, with_norms=True)
        assert_norms_match(norms, ref_norms)
        for name, r in ref.items():
            assert (masters[name] - r).abs().max().item() <= ATOL, (offload, gas, name)
            assert (params[name] - r).abs().max().item() <= ATOL, (offload, gas, name)
        assert losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.parametrize("offload,gas", [("both", 1), ("param", 3), ("none", 1)])
def test_bf16_loss_curve_within_bound(offload, gas):
    """Same bound as stages 0-2 (test_mixed_precision): 2 x bf16 unit roundoff relative, over 10 steps."""
    _, ref = reference_run(gas=gas, ws=2, steps=10, dtype=torch.bfloat16)
    _, _, losses = run_ranks(engine_runs, 2, [stage3_config(offload, gas, "bf16", ws=2)], 10)[0][0]
    assert max(abs(a - b) / b for a, b in zip(losses, ref)) <= 2 * 2.0**-8


# -- memory ---------------------------------------------------------------------------------------------
N_PARAMS = sum(p.numel() for p in make_model().parameters())


def _memory_after_step(config):
    engine = zero_offload.initialize(make_model(), config)
    for step in range(2):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y))
        engine.step()
    return engine.memory_breakdown(), len(list(engine.module.parameters()))   # at least one per unit


@pytest.mark.parametrize("offload", ["none", "both"])
def test_each_rank_holds_half_of_everything(offload):
    from zero_offload.zero.flat import ALIGNMENT
    cfg = stage3_config(offload, ws=2, precision="bf16", stage3_max_reuse_distance=0)
    for breakdown, tensors in run_ranks(_memory_after_step, 2, cfg):
        slack = tensors * ALIGNMENT      # each unit's padding is under one alignment
        assert N_PARAMS / 2 <= breakdown["params"]["numel"] < N_PARAMS / 2 + slack
        for kind in ("master", "exp_avg", "exp_avg_sq", "grad_partition"):
            assert N_PARAMS / 2 <= breakdown[kind]["numel"] < N_PARAMS / 2 + slack, kind
        side = "host" if offload == "both" else "device"
        assert breakdown["params"]["side"] == side and breakdown["master"]["side"] == side
        # Gathered at once, at most: well under the whole 16-bit model (the prefetch window + tied units).
        assert 0 < breakdown["peak_gathered"]["bytes"] < 0.6 * 2 * N_PARAMS
        assert breakdown["gathered"]["bytes"] < 0.1 * 2 * N_PARAMS     # after the step: persistent ones only


# -- the awkward cases -----------------------------------------------------------------------------------
class Branchy(ToyTransformer):
    """Skips its second block when ``skip`` is set: control flow that changes between steps."""
    skip = False

    def forward(self, idx, targets):
        blocks, self.blocks = self.blocks, self.blocks[:1] if self.skip else self.blocks
        try:
            return super().forward(idx, targets)
        finally:
            self.blocks = blocks


class Twice(ToyTransformer):
    """Runs its first block twice in one forward."""

    def forward(self, idx, targets):
        blocks = self.blocks
        self.blocks = torch.nn.ModuleList([blocks[0], blocks[0], blocks[1]])
        try:
            return super().forward(idx, targets)
        finally:
            self.blocks = blocks


class WithFrozenAndUnused(ToyTransformer):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)          # never called: no gradient ever
        self.wpe.weight.requires_grad_(False)        # frozen


def _train_variant(cls, config, steps=5):
    torch.manual_seed(0)
    model = cls()
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    engine = zero_offload.initialize(model, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            model.skip = step >= 2
            x, y = batch(step, MICRO * ws)
            engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
            engine.step()
    return engine.full_state_dict(), [str(w.message) for w in caught]


def _reference_variant(cls, ws, steps=5):
    torch.manual_seed(0)
    model = cls()
    from reference import LR, WD
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step in range(steps):
        model.skip = step >= 2
        x, y = batch(step, MICRO * ws)
        opt.zero_grad()
        model(x, y).backward()
        for p in model.parameters():           # the engine gives unused parameters a zero gradient
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}   # frozen ones too: full_state_dict has them


@pytest.mark.parametrize("ws", (1, 2))
@pytest.mark.parametrize("cls", [Branchy, Twice, WithFrozenAndUnused], ids=lambda c: c.__name__)
def test_awkward_models_match_adamw(cls, ws):
    cfg = stage3_config("both", ws=ws)
    state, messages = (_train_variant(cls, cfg) if ws == 1 else run_ranks(_train_variant, 2, cls, cfg)[0])
    ref = _reference_variant(cls, ws)
    assert state.keys() == ref.keys()
    for name, r in ref.items():
        assert (state[name] - r).abs().max().item() <= ATOL, name
    order_warnings = [m for m in messages if "different order" in m]
    assert len(order_warnings) == (1 if cls is Branchy else 0)


def test_parameters_outside_forward_need_gathered_parameters():
    engine = zero_offload.initialize(make_model(), stage3_config("both"))
    x, y = batch(0, MICRO)
    engine.backward(engine(x, y))
    engine.step()
    weight = engine.module.blocks[0].fc.weight
    assert weight.shape == (0,)                  # released: a shard lives elsewhere
    with zero_offload.gathered_parameters([weight]):
        assert weight.shape == (128, 32)
        seen = weight.detach().clone()
    assert weight.shape == (0,)
    assert torch.equal(seen, engine.full_state_dict()["blocks.0.fc.weight"])


# -- prefetch, observed from outside ----------------------------------------------------------------------
class ForwardLog:
    """What each logged forward did, seen from outside the engine: every unit gather launched
    (`ShardedUnit.gather` wrapped: the all-gather, after the copy up of a host shard) and where each module
    holding parameters begins and ends its forward (hooks on the test's own model; the pre-hook runs before
    the engine's, so a gather the engine makes for this module is logged after its "pre")."""

    def __init__(self, model, monkeypatch):
        self.logs, self._log = [], None
        original = ShardedUnit.gather

        def gather(unit, ctx, copies, async_op, *args, **kwargs):
            self._add(("gather", frozenset(map(id, unit.params)), unit.numel, async_op))
            return original(unit, ctx, copies, async_op, *args, **kwargs)
        monkeypatch.setattr(ShardedUnit, "gather", gather)
        for name, m in model.named_modules():
            params = frozenset(map(id, m.parameters(recurse=False)))    # a tied weight: the same ids
            if params:
                m.register_forward_pre_hook(lambda m, a, e=("pre", name, params): self._add(e), prepend=True)
                m.register_forward_hook(lambda m, a, o, e=("post", name, params): self._add(e), prepend=True)

    def _add(self, event):
        if self._log is not None:
            self._log.append(event)

    @contextlib.contextmanager
    def logged(self):
        self._log = []
        try:
            yield
        finally:
            self.logs.append(self._log)
            self._log = None


def unit_uses(events):
    """One logged forward as ([(module, how, look-ahead)] in order, [(async_op, elements, units)] per gather
    launched ahead).

    how: "ahead" -- its units were gathered before the module began, while ``look-ahead`` (>= 1) other modules
    ran to their end; "on demand" -- gathered after it began; "kept" -- still gathered from an earlier use.
    elements, units: what was already gathered ahead and not yet used when that gather was launched."""
    uses, ahead, pending, running = [], [], {}, frozenset()    # pending: params -> (event index, numel)
    for i, event in enumerate(events):
        if event[0] == "pre":
            running = event[2]
            came = [k for k in pending if k & running]
            depth = min((sum(f[0] == "post" for f in events[pending[k][0]:i]) for k in came), default=0)
            uses.append([event[1], "ahead" if came else "kept", depth])
            for k in came:
                del pending[k]
        elif event[0] == "post":
            running = frozenset()
        elif event[1] & running:
            uses[-1][1:] = ["on demand", 0]
        else:
            ahead.append((event[3], sum(n for _, n in pending.values()), len(pending)))
            pending[event[1]] = (i, event[2])
    return [tuple(u) for u in uses], ahead


def check_prefetch(logs, bucket):
    """The first forward records the order and gathers on demand; later ones gather each module's units
    while earlier modules run, within ``bucket`` elements ahead (none ahead with bucket 0). Returns the most
    units gathered ahead at once."""
    (uses, ahead), *later = [unit_uses(events) for events in logs]
    assert ahead == [] and {how for _, how, _ in uses} <= {"on demand", "kept"}, uses
    assert later
    most = 0
    for uses, ahead in later:
        assert uses[0][1] == "on demand", uses           # nothing runs before the first module
        if bucket == 0:
            assert ahead == [] and "on demand" in {how for _, how, _ in uses[1:]}, uses
            continue
        assert all(how == "kept" or (how == "ahead" and depth >= 1) for _, how, depth in uses[1:]), uses
        assert sum(how == "ahead" for _, how, _ in uses) >= len(uses) // 2, uses   # not "kept" all along
        assert all(async_op for async_op, _, _ in ahead), "a prefetch waited for its own gather"
        assert all(elements < bucket for _, elements, _ in ahead), (bucket, ahead)   # the look-ahead's limit
        most = max(most, *(units + 1 for _, _, units in ahead))
    return most


@pytest.mark.parametrize("offload", ["none", "param"])
@pytest.mark.parametrize("bucket,most", [(0, 0), (1, 1), (3000, 5)])
def test_later_steps_gather_each_module_while_earlier_ones_run(monkeypatch, offload, bucket, most):
    """After the first step records the order, a unit's gather (the host-to-device copy too, with offload_param)
    is launched while earlier modules still compute: stage3_prefetch_bucket_size elements ahead, one unit with
    bucket 1, five of the toy's units (256 + 64 + 1024 + 1024 elements, then the one that passes 3000) with
    bucket 3000, none with bucket 0. The results stay exact."""
    cfg = stage3_config(offload)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket
    engine = zero_offload.initialize(make_model(), cfg)
    forwards = ForwardLog(engine.module, monkeypatch)
    losses = []
    for step in range(3):
        x, y = batch(step, MICRO)
        with forwards.logged():
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert check_prefetch(forwards.logs, bucket) == most
    ref, ref_losses = reference_run(steps=3)
    masters = engine.full_state_dict()
    for name, r in ref.items():
        assert (masters[name] - r).abs().max().item() <= ATOL, name
    assert losses == pytest.approx(ref_losses, abs=1e-5)


# -- models larger than one rank -------------------------------------------------------------------------
def _sharded_init_run(config):
    torch.manual_seed(0)
    with zero_offload.init_sharded():
        model = ToyTransformer()
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(1)
    engine = zero_offload.initialize(model, config)
    held = engine.memory_breakdown()
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    x, y = batch(0, MICRO * ws)
    engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
    engine.step()
    return engine.full_state_dict(), held, engine.memory_breakdown(), engine.zero.peak_materialize_bytes


def test_init_sharded_never_holds_the_model():
    cfg = stage3_config("none", ws=2, stage3_max_reuse_distance=0)
    results = run_ranks(_sharded_init_run, 2, cfg)
    torch.manual_seed(0)
    ref = ToyTransformer()                # init_sharded keeps the constructor's values: a normal build
    from reference import LR, WD
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    x, y = batch(0, MICRO * 2)
    ref(x, y).backward()
    opt.step()
    full_bytes = 4 * N_PARAMS             # fp32 parameters
    for state, held, after, peak_init in results:
        assert held["params"]["bytes"] < full_bytes / 2 + 4 * 64 * len(state)   # about 4 x params / N
        # Peak while materialising: one module plus the tied embedding still open -- never the model.
        assert 0 < peak_init < 0.25 * full_bytes
        assert after["peak_gathered"]["bytes"] < 0.6 * full_bytes
        for name, p in ref.named_parameters():
            assert (state[name] - p.detach()).abs().max().item() <= ATOL, name

