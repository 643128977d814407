"""Muon under ZeRO (docs/muon.md): DeepSpeed's ``"type": "Muon"`` against DeepSpeed's own ``MuonWithAuxAdam`` as a
plain optimizer, and ``torch.optim.Muon`` + ``torch.optim.AdamW`` handed to ``deepspeed.initialize`` against the
same two torch optimizers (`muon_reference`): stages 0-3, the optimizer on the device or offloaded to the CPU,
1 and 2 ranks, accumulation 1 and 3, clipping that fires on some steps; weights within 1e-5 after 5 steps. Each
mutation of the owner scheme below must fail: a shard orthogonalized instead of the whole matrix, a rank given
another rank's result, Nesterov dropped, an overflow step folded into the momentum."""
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

import zero_offload
from dist_utils import run_ranks
from muon_reference import (MICRO, MUON, MuonReference16, deepspeed_muon, fp32_iteration, reference_run,
                            torch_muon)
from reference16 import lockstep_run
from reference import assert_estimated, engine_run, one_step_breakdown, train_step
from toy_model import batch, make_model
from zero_offload.config import ConfigError

# The toy model's global gradient norms over these 5 steps lie between about 6.3 and 7.5 (ws 2, gas 3): a clip of
# 7.0 fires on the first step and not on the others (checked in the test). In DeepSpeed's ZeRO order the norm counts
# the Muon matrices' orthogonalized updates instead, between about 22.6 and 22.9: a clip of 22.7 fires on some steps.
CLIP = 7.0
CLIP_UPDATE = 22.7


def _config(stage=2, offload="none", gas=1, clip=0.0, params=MUON, **zero):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "optimizer": {"type": "Muon", "params": params},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload},
                                  "reduce_bucket_size": 500, **zero}}


def _nvme(config, path, params=False):
    """``config`` with the optimizer states (and with ``params`` stage 3's parameters) in swap files under
    ``path``: sub-groups of 3072 elements, read ahead and written behind, so sub-groups cross the rounds'
    boundaries under `_small_rounds`."""
    path.mkdir(parents=True, exist_ok=True)
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path), "buffer_count": 3,
                                 "pipeline_read": True, "pipeline_write": True}
    zero["sub_group_size"] = 3000
    if params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path), "buffer_count": 4}
    return config


def _small_rounds():
    """Rounds of at most 5000 elements: the toy model's matrices take 7 rounds instead of one."""
    from zero_offload.hoststep import muon_owners
    muon_owners.ROUND_NUMEL = 5000


def _run(config, mutation=None, fp32=True, steps=5):
    """One rank's engine run, in a process of its own (`run_ranks`): mutations and the fp32 patch end with it."""
    if mutation is not None:
        mutation()
    with fp32_iteration() if fp32 else nullcontext():
        full, _, _, norms = engine_run(config, steps=steps, with_norms=True)
    return full, norms


def _max_error(full, ref):
    return max((full[k] - v).abs().max().item() for k, v in ref.items())


CASES = [(0, "none", 1), (1, "cpu", 3), (2, "none", 3), (2, "cpu", 1), (3, "cpu", 3), (3, "none", 1)]


@pytest.mark.parametrize("stage,offload,gas", CASES)
def test_deepspeed_muon_two_ranks(stage, offload, gas):
    """At stages 1-3 the clip covers the orthogonalized update, as in DeepSpeed's ZeRO (`zero_order_step`)."""
    clip = (CLIP_UPDATE if stage >= 1 else CLIP) if gas == 3 else 0.0
    ref = reference_run(lambda m: deepspeed_muon(MUON, m), ws=2, gas=gas, clip=clip, clip_update=stage >= 1)
    for full, norms in run_ranks(_run, 2, _config(stage, offload, gas, clip)):
        assert _max_error(full, ref) <= 1e-5
        if clip:
            assert min(norms) < clip < max(norms), norms          # clipping fires on some steps only


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "none")])
def test_deepspeed_muon_one_rank(stage, offload):
    ref = reference_run(lambda m: deepspeed_muon(MUON, m))
    full, _ = _run(_config(stage, offload))
    assert _max_error(full, ref) <= 1e-5


# Round by round (several rounds) in memory and in swap files; stage 3 with its parameters on NVMe too.
ROUND_CASES = [(2, "nvme", 3, False), (1, "cpu", 3, False), (3, "nvme", 1, True), (3, "nvme", 3, False)]


@pytest.mark.parametrize("stage,offload,gas,params", ROUND_CASES)
def test_deepspeed_muon_rounds_and_nvme(stage, offload, gas, params, tmp_path):
    clip = (CLIP if offload == "nvme" else CLIP_UPDATE) if gas == 3 else 0.0
    config = _config(stage, offload, gas, clip)
    if offload == "nvme":          # states in swap files: the gradient is clipped (the update's order is not built)
        _nvme(config, tmp_path, params)
    ref = reference_run(lambda m: deepspeed_muon(MUON, m), ws=2, gas=gas, clip=clip, clip_update=offload != "nvme")
    for full, norms in run_ranks(_run, 2, config, _small_rounds):
        assert _max_error(full, ref) <= 1e-5
        if clip:
            assert min(norms) < clip < max(norms), norms


def test_deepspeed_muon_nvme_one_rank(tmp_path):
    ref = reference_run(lambda m: deepspeed_muon(MUON, m))
    full, _ = _run(_nvme(_config(2), tmp_path))
    assert _max_error(full, ref) <= 1e-5


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_sixteen_bit_iteration_first_step(method):
    """The iteration in its own dtype (bf16 for ``standard``; ``gram`` in fp16 where the CPU has it, else fp32),
    one step at 1 rank: the gradient is then the reference's bit for bit, so the 16-bit update is too. (After it,
    the Adam half's last-bit differences from torch's AdamW reach the next gradients, and a 16-bit iteration turns
    them into whole ulps: the 5-step matrix runs the iteration in fp32.)"""
    params = dict(MUON, ns_method=method)
    ref = reference_run(lambda m: deepspeed_muon(params, m), fp32=False, steps=1)
    full, _ = _run(_config(2, "cpu", params=params), fp32=False, steps=1)
    assert _max_error(full, ref) <= 1e-6


TORCH_MUON = dict(lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw")
TORCH_ADAMW = dict(lr=0.004, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _client_run(stage, offload, fp32=True, steps=5, nvme_path=None):
    with fp32_iteration() if fp32 else nullcontext():
        return _client_steps(stage, offload, steps, nvme_path)


def _client_steps(stage, offload, steps, nvme_path):
    import zero_offload.deepspeed as ds
    rank = dist.get_rank() if dist.is_initialized() else 0
    ws = dist.get_world_size() if dist.is_initialized() else 1
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload},
                                    "reduce_bucket_size": 500}}
    if offload == "nvme":
        _nvme(config, nvme_path)
    engine, *_ = ds.initialize(model=model, config=config, optimizer=torch_muon(model, TORCH_MUON, TORCH_ADAMW))
    for step in range(steps):
        x, y = batch(step, MICRO * ws)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (3, "cpu"), (2, "nvme")])
def test_torch_muon_client(stage, offload, tmp_path):
    ref = reference_run(lambda m: torch_muon(m, TORCH_MUON, TORCH_ADAMW), ws=2)
    for full in run_ranks(_client_run, 2, stage, offload, True, 5, tmp_path):
        assert _max_error(full, ref) <= 1e-5


def test_torch_muon_client_bf16_iteration_first_step():
    """torch's own bf16 iteration, one step at 1 rank (see `test_sixteen_bit_iteration_first_step`)."""
    ref = reference_run(lambda m: torch_muon(m, TORCH_MUON, TORCH_ADAMW), fp32=False, steps=1)
    full = _client_run(2, "cpu", fp32=False, steps=1)
    assert _max_error(full, ref) <= 1e-6


def test_torch_muon_alone_names_how_to_pass_both():
    import zero_offload.deepspeed as ds
    model = make_model()
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2])
    with pytest.raises(ValueError, match=r"optimizer=\[torch.optim.Muon\(matrices, ...\), torch.optim.AdamW"):
        ds.initialize(model=model, config={"train_micro_batch_size_per_gpu": MICRO}, optimizer=muon)


def _lockstep(stage, offload, gas, clip, precision):
    # The lockstep reference follows the gradient through the clip: the optimizer alone's order (clip "gradient").
    config = _config(stage, offload, gas, clip, params=dict(MUON, clip="gradient"))
    config[precision] = {"enabled": True, **({"loss_scale": 1024} if precision == "fp16" else {})}
    reference = dict(precision=precision, stage=stage, gas=gas, clip=clip,
                     loss_scale=1024.0 if precision == "fp16" else 1.0)
    with fp32_iteration(), torch._dynamo.config.patch(disable=True):
        return lockstep_run(config, reference, steps=3, reference_class=MuonReference16)


@pytest.mark.parametrize("stage,offload,gas,clip,precision", [(2, "cpu", 3, CLIP, "bf16"), (1, "cpu", 1, 0.0, "fp16"),
                                                              (3, "none", 3, 0.0, "bf16"),
                                                              (0, "none", 1, CLIP, "fp16")])
def test_sixteen_bit_lockstep(stage, offload, gas, clip, precision):
    """bf16 and fp16 (static loss scale 1024) on 2 ranks, each step from the engine's own masters against
    `MuonReference16` (its bound derived there): every master within it, the 16-bit weights the rounded masters."""
    for steps in run_ranks(_lockstep, 2, stage, offload, gas, clip, precision):
        for s in steps:
            assert s["masters_ratio"] <= 1.0, s
            assert s["weights_ulp"] == 0.0, s


# -- power: each mutation of the scheme must move the weights past the bound -------------------------------------
def _shard_only():
    """Orthogonalize each rank's pieces on their own, as one-row matrices, instead of the owner's whole matrix."""
    from zero_offload.hoststep import muon_owners
    from zero_offload.optim.muon import orthogonalize

    def local(self, i, updates, results, bases=None):
        for m in self.rounds[i][0]:
            at = (bases or {}).get(m.group, 0)
            for p in self.held(m, self.rank):
                lo, hi = p.part_offset - at, p.part_offset - at + p.length
                results[m.group][lo:hi] = orthogonalize(updates[m.group][lo:hi].view(1, -1), self.rules[m.group])
    muon_owners.MuonOwners.orthogonalize_round = local


def _wrong_rank():
    """Each rank receives the next rank's results (as far as they reach) instead of its own."""
    from zero_offload.hoststep import muon_owners
    original = muon_owners.MuonOwners.orthogonalize_round

    def rotated(self, i, updates, results, bases=None):
        original(self, i, updates, results, bases)
        for g in (g for g, rule in enumerate(self.rules) if rule is not None):
            mine = results.get(g, torch.zeros(0))
            size = torch.tensor([mine.numel()])
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
            padded = torch.zeros(int(size))
            padded[:mine.numel()] = mine
            every = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(every, padded)
            mine.copy_(every[(self.rank + 1) % self.world][:mine.numel()])
    muon_owners.MuonOwners.orthogonalize_round = rotated


def _no_nesterov():
    """The update is the momentum itself, not Nesterov's lerp of the gradient towards it."""
    import dataclasses
    from zero_offload.hoststep import muon
    original = muon.momentum_pass

    def plain(momentum, grad, grad_scale, rule, out):
        return original(momentum, grad, grad_scale, dataclasses.replace(rule, nesterov=False), out=out)
    muon.momentum_pass = plain


@pytest.mark.parametrize("mutation", [_shard_only, _wrong_rank, _no_nesterov])
def test_mutations_fail(mutation):
    ref = reference_run(lambda m: deepspeed_muon(MUON, m), ws=2)
    for full, _ in run_ranks(_run, 2, _config(2, "cpu"), mutation):
        assert _max_error(full, ref) > 1e-4


def _overflow_run(fold, monkeypatch):
    """fp16 whose first steps overflow (loss scale 2^40): the skipped steps leave the momentum as it was."""
    from zero_offload.hoststep.pipeline import HostStepPipeline
    if fold:      # the mutation: a skipped step still folds its (non-finite) gradient into the momentum
        def discard(self):
            for g, m in self.zero.adam.momenta.items():
                m.lerp_(self.zero.partitions[g].ready().float(), 0.05)
        monkeypatch.setattr(HostStepPipeline, "discard", discard)
    config = _config(2, "cpu", params=MUON)
    config["fp16"] = {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 1000}
    engine = zero_offload.initialize(make_model(), config)
    momenta = []
    for step in range(2):
        train_step(engine, step, 0, 1)
        momenta.append([m.clone() for m in engine.zero.adam.momenta.values()])
    return engine.skipped_steps, momenta


@pytest.mark.parametrize("fold", [False, True])
def test_overflow_leaves_momentum(fold, monkeypatch):
    skipped, momenta = _overflow_run(fold, monkeypatch)
    assert skipped == 2
    unchanged = all(torch.count_nonzero(m) == 0 for step in momenta for m in step)
    assert unchanged != fold


def test_refusals_name_the_key():
    for zero, key in (({"offload_optimizer": {"device": "cpu", "delayed_param_update": True}},
                       "delayed_param_update"),
                      ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, "super_offload"),
                      ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "ratio"),
                      ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "bf16_optimizer_states")):
        config = _config(2, **{"offload": "cpu"})
        config["zero_optimization"].update(zero)
        if key == "bf16_optimizer_states":
            config["bf16"] = {"enabled": True, "bf16_optimizer_states": True}
        with pytest.raises(ConfigError, match=key):
            zero_offload.initialize(make_model(), config)
    with pytest.raises(ConfigError, match="per_head_muon"):
        zero_offload.initialize(make_model(), _config(2, params=dict(MUON, per_head_muon=True)))
    with pytest.raises(ConfigError, match="ns_method"):
        zero_offload.initialize(make_model(), _config(2, params=dict(MUON, ns_method="cubic")))


@fp32_iteration()
def test_owners_balance_and_checkpoint(tmp_path):
    from zero_offload.hoststep.muon_owners import assign_owners
    assert assign_owners([(64, 64), (8, 8), (8, 8), (32, 32)], 2) == [0, 1, 1, 1]
    engine = zero_offload.initialize(make_model(), _config(2, "cpu"))
    for step in range(2):
        train_step(engine, step, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="t")
    before = {g: m.clone() for g, m in engine.zero.adam.momenta.items()}
    resumed = zero_offload.initialize(make_model(), _config(3, "none"))
    resumed.load_checkpoint(str(tmp_path), tag="t")
    train_step(engine, 2, 0, 1)
    train_step(resumed, 2, 0, 1)
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert all(torch.count_nonzero(m) > 0 for m in before.values())
    adam = _config(2, "cpu")
    adam["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    with pytest.raises(Exception, match="muon"):
        zero_offload.initialize(make_model(), adam).load_checkpoint(str(tmp_path), tag="t")


@fp32_iteration()
def test_nvme_checkpoint_reshards(tmp_path):
    """Swap-file states save and resume in memory, and memory's in swap files (stage 3's parameters on NVMe too):
    the momentum travels in the ``exp_avg`` slot (a resume without it moves the next step far past 1e-6)."""
    configs = (_nvme(_config(2), tmp_path / "a"), _config(1, "cpu"), _nvme(_config(3), tmp_path / "b", params=True))
    for saver, loader in zip(configs, configs[1:]):
        engine = zero_offload.initialize(make_model(), saver)
        for step in range(2):
            train_step(engine, step, 0, 1)
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        resumed = zero_offload.initialize(make_model(), loader)
        resumed.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        train_step(engine, 2, 0, 1)
        train_step(resumed, 2, 0, 1)
        a, b = engine.full_state_dict(), resumed.full_state_dict()
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
        engine.close()
        resumed.close()


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (2, "cpu"), (2, "none"), (3, "cpu"), (3, "none"),
                                           (2, "nvme"), (3, "nvme")])
def test_breakdown_matches_estimate(stage, offload, tmp_path):
    """``memory_breakdown()`` after a step and ``estimate_memory`` agree to the byte on every model-state kind: the
    Muon group's momentum (4 B per element, under ``exp_avg``) and no ``exp_avg_sq`` for it (in memory, or as
    swap files: stage 3 with its parameters on NVMe too)."""
    config = _config(stage, offload)
    if offload == "nvme":
        _nvme(config, tmp_path, params=stage == 3)
    held = one_step_breakdown(config)
    assert_estimated(held, config)
    n_muon = sum(p.numel() for n, p in make_model().named_parameters() if p.dim() >= 2)
    # exp_avg: the momentum and the Adam half's first moment; exp_avg_sq: the Adam half's only
    assert held["exp_avg"]["bytes"] - held["exp_avg_sq"]["bytes"] >= 4 * n_muon


def test_planner_knows_muon():
    """The planner never picks what Muon is not built with (the delayed update, super_offload, ratio < 1), its
    memory has the momentum instead of two moments, and its host step holds the owners' Newton-Schulz."""
    from zero_offload.config import Config
    from zero_offload.estimate import estimate_memory, plan
    from zero_offload.estimate.shape import model_shape
    from zero_offload.optim.muon import ns_flops
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "optimizer": {"type": "Muon"},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    chosen = plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="256GB", config=config, gpu_flops=4.0e14)
    assert chosen.fits and Config.load(chosen.config).optimizer.type == "Muon"
    oo = chosen.config["zero_optimization"].get("offload_optimizer", {})
    assert not oo.get("delayed_param_update") and not oo.get("super_offload") and oo.get("ratio", 1.0) == 1.0
    timing = next(r for r in chosen.rows if r.name == chosen.name).batch.timing
    shape = model_shape("gpt2-10b", muon=True)
    assert timing.host_s > sum(ns_flops(m) for m in shape.muon_matrices) / 4.0e14
    adam = dict(config, optimizer={"type": "AdamW"})
    muon_host = estimate_memory("gpt2-10b", config, accelerator=True).host
    adam_host = estimate_memory("gpt2-10b", adam, accelerator=True).host
    assert muon_host["exp_avg_sq"] < 0.01 * adam_host["exp_avg_sq"] and muon_host["exp_avg"] == adam_host["exp_avg"]


def test_clip_order_that_is_not_built_is_refused_naming_the_key(tmp_path):
    """``"clip": "update"`` (DeepSpeed's ZeRO order) with the torch flavor or with states in swap files is refused;
    with states in swap files and no ``clip`` given the gradient is clipped, with a warning naming the key."""
    with pytest.raises(ConfigError, match="'optimizer.params.clip' = 'update'.*torch flavor"):
        zero_offload.initialize(make_model(), _config(2, clip=CLIP, params=dict(MUON, flavor="torch", clip="update")))
    with pytest.raises(ConfigError, match="'optimizer.params.clip' = 'update'.*'nvme'"):
        zero_offload.initialize(make_model(), _nvme(_config(2, clip=CLIP, params=dict(MUON, clip="update")),
                                                    tmp_path / "a"))
    with pytest.warns(UserWarning, match="'optimizer.params.clip': 'gradient'"):
        engine = zero_offload.initialize(make_model(), _nvme(_config(2, clip=CLIP), tmp_path / "b"))
    engine.close()
