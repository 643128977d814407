"""Switching from DeepSpeed to zero-offload in the middle of a run (issue 30, items 1, 4 and 5): DeepSpeed 0.19
(CPU accelerator, gloo, fp32, torch's AdamW, a warm-up LR schedule) trains N steps and saves; zero-offload loads
the checkpoint, at another stage and world size, and trains M more. The result equals plain AdamW's uninterrupted
N + M run within 1e-5, and so does DeepSpeed's own (the peer agrees with the reference). Skipped, naming the
package, where DeepSpeed is not installed; CI installs it.
"""
from __future__ import annotations

import pytest
import torch

from zero_offload.checkpoint import CheckpointError

from deepspeed_peer import (N, ds_train_and_save, max_diff, needs_deepspeed, our_config, ours_resume,
                            ours_resume_on_ranks, reference, to_universal)
from dist_utils import run_ranks

pytestmark = needs_deepspeed


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """DeepSpeed checkpoints, written once per (stage, ranks, offload): {key: (path, DeepSpeed's N + M result)}."""
    cache = {}

    def get(stage: int, world: int, offload: bool, universal: bool = False):
        key = (stage, world, offload)
        if key not in cache:
            path = str(tmp_path_factory.mktemp("ds") / f"s{stage}w{world}{'o' if offload else ''}")
            cache[key] = (path, run_ranks(ds_train_and_save, world, path, stage, offload)[0])
        path, result = cache[key]
        if universal and not (ds := f"{path}-universal") in cache:
            to_universal(path)
            cache[ds] = True
        return (f"{path}-universal" if universal else path), result
    return get


# (DeepSpeed's stage, its ranks, its offload) -> (our stage, our ranks, our offload): every DeepSpeed stage, with
# and without offload, from 2 ranks to 1 and from 1 to 2.
CASES = [((1, 2, False), (2, 1, True)), ((2, 2, True), (3, 1, True)), ((3, 2, False), (0, 1, False)),
         ((3, 2, True), (2, 2, True)), ((2, 1, False), (3, 2, False)), ((1, 1, True), (1, 2, False))]


@pytest.mark.parametrize("theirs,ours", CASES, ids=[f"ds{t}-to-ours{o}" for t, o in CASES])
def test_a_deepspeed_checkpoint_resumes_exactly(saved, theirs, ours):
    path, deepspeed_result = saved(*theirs)
    expected = reference()
    assert max_diff(deepspeed_result, expected) <= 1e-5          # the peer's own uninterrupted run
    stage, world, offload = ours
    if world == 1:
        result, client_state = ours_resume(path, stage, offload)
        assert client_state == {"epoch": 7}
        results = [result]
    else:
        results = [r for r, _ in run_ranks(ours_resume_on_ranks, world, path, stage, offload)]
    assert max(max_diff(r, expected) for r in results) <= 1e-5


@pytest.mark.parametrize("theirs,ours", [((3, 2, False), (2, 1, True)), ((2, 2, True), (3, 2, False))],
                         ids=["ds-stage3-to-ours-stage2", "ds-stage2-to-ours-stage3-two-ranks"])
def test_a_universal_checkpoint_from_ds_to_universal_resumes_exactly(saved, theirs, ours):
    path, _ = saved(*theirs, universal=True)
    stage, world, offload = ours
    if world == 1:
        results = [ours_resume(path, stage, offload)[0]]
    else:
        results = [r for r, _ in run_ranks(ours_resume_on_ranks, world, path, stage, offload)]
    assert max(max_diff(r, reference()) for r in results) <= 1e-5


def test_the_check_sees_moments_or_schedule_not_loaded(saved):
    """Power: a resume without Adam's moments (load_optimizer_states=False), or without the LR schedule, ends
    elsewhere: the 1e-5 bound above sees both."""
    path, _ = saved(2, 2, True)
    without_moments, _ = ours_resume(path, 2, True, load_optimizer_states=False)
    assert max_diff(without_moments, reference()) > 1e-4
    without_schedule, _ = ours_resume(path, 2, True, load_lr_scheduler_states=False)
    assert max_diff(without_schedule, reference()) > 1e-4


def _gpt(**change):
    import dataclasses
    from deepspeed_peer import SHAPE
    from zero_offload.train.model import GPT
    return GPT(dataclasses.replace(SHAPE, **change))


def _refused(path, model: torch.nn.Module, match: str) -> None:
    """Loading ``path`` into an engine of ``model`` fails with ``match`` and leaves every master as it was."""
    import warnings
    import zero_offload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zero_offload.initialize(model, our_config(2, True))
    try:
        before = engine.full_state_dict()
        step = engine.global_step
        with pytest.raises(CheckpointError, match=match):
            engine.load_checkpoint(str(path))
        assert engine.global_step == step
        assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    finally:
        engine.close()


def test_a_damaged_or_foreign_deepspeed_checkpoint_is_refused_before_anything_changes(saved, tmp_path):
    import shutil
    from deepspeed_peer import make_model
    source, _ = saved(2, 2, True)
    path = tmp_path / "ds"
    shutil.copytree(source, path)
    tag = path / f"global_step{N}"
    _refused(path, _gpt(vocab_size=65), r"parameter 'transformer.wte.weight' has shape \[64, 32\] there and "
                                        r"\[65, 32\] here")
    _refused(path, _gpt(n_layer=3), r"it has no parameter 'transformer\.h\.2\.")
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = rank1.read_bytes()
    rank1.write_bytes(data[:len(data) // 2])                     # truncated
    _refused(path, make_model(), rf"file '{rank1}' cannot be read")
    rank1.unlink()                                              # missing
    _refused(path, make_model(), rf"file '{rank1}' is missing: the checkpoint was written by 2 ranks")


def test_what_cannot_be_mapped_is_refused_naming_the_reason(saved, tmp_path):
    import shutil
    from deepspeed_peer import make_model
    source, _ = saved(2, 2, True)
    path = tmp_path / "ds"
    shutil.copytree(source, path)
    tag = path / f"global_step{N}"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    _refused(path, make_model(), r"tensor-parallel rank files \('mp_rank_01_model_states.pt'\)")
    (tag / "mp_rank_01_model_states.pt").unlink()
    (tag / "offloaded_tensors").mkdir()
    _refused(path, make_model(), r"keeps its optimizer state in NVMe swap files")


# Ours (stage, ranks, offload) writes universal -> DeepSpeed (stage, ranks, offload) resumes it. DeepSpeed's stage-3
# universal load gives every param group the first group's hyperparameters (stage3.py,
# load_hp_checkpoint_state_from_checkpoint_dir_stage3), so its stage-3 cases train one group, as a run whose
# groups differ would not resume exactly in DeepSpeed from its own ds_to_universal output either.
BACK = [((2, 1, True), (3, 2, False), False), ((3, 2, True), (1, 1, False), True),
        ((0, 1, False), (2, 2, True), True), ((3, 1, False), (3, 1, True), False)]


@pytest.mark.parametrize("ours,theirs,grouped", BACK, ids=[f"ours{o}-to-ds{t}" for o, t, _ in BACK])
def test_deepspeed_resumes_a_universal_checkpoint_written_here(tmp_path, ours, theirs, grouped):
    """Issue 30, item 3: zero-offload trains N steps and writes DeepSpeed's universal layout
    (save_checkpoint(format="deepspeed-universal")); DeepSpeed resumes it with load_universal at another stage
    and world size and trains M more, ending on the uninterrupted run's weights."""
    from deepspeed_peer import ds_resume, ours_train_and_save
    stage, world, offload = ours
    run_ranks(ours_train_and_save, world, str(tmp_path / "uc"), stage, offload, grouped)
    assert (tmp_path / "uc" / "latest_universal").read_text() == f"global_step{N}"
    assert not list(tmp_path.glob(".*zero-offload")) and not list((tmp_path / "uc").glob(".tmp-*"))
    ds_stage, ds_world, ds_offload = theirs
    results = run_ranks(ds_resume, ds_world, str(tmp_path / "uc"), ds_stage, ds_offload, grouped)
    assert max(max_diff(r, reference(grouped=grouped)) for r in results) <= 1e-5


def test_the_deepspeed_check_sees_moments_that_were_not_written(tmp_path, monkeypatch):
    """Power: a universal checkpoint written with its moments zeroed makes DeepSpeed's resumed run end elsewhere."""
    from deepspeed_peer import ds_resume, ours_train_and_save
    from zero_offload.checkpoint import load
    full = load.full_parameters

    def zeroed(directory, manifest, kind="master"):
        for name, t in full(directory, manifest, kind):
            yield name, t if kind == "master" else torch.zeros_like(t)
    monkeypatch.setattr(load, "full_parameters", zeroed)
    run_ranks(ours_train_and_save, 1, str(tmp_path / "uc"), 2, True)
    results = run_ranks(ds_resume, 1, str(tmp_path / "uc"), 2, False)
    assert max_diff(results[0], reference()) > 1e-4


def test_our_universal_checkpoint_loads_back_here(tmp_path):
    """The universal layout we write is one our reader takes too (at another stage and world size)."""
    from deepspeed_peer import ours_train_and_save
    run_ranks(ours_train_and_save, 2, str(tmp_path / "uc"), 3, True)
    result, client_state = ours_resume(str(tmp_path / "uc"), 1, False)
    assert client_state == {}
    assert max_diff(result, reference()) <= 1e-5


def _fp16_engine(scale_power: int = 4):
    import warnings
    import zero_offload
    from deepspeed_peer import groups, make_model
    config = {**our_config(2, True), "fp16": {"enabled": True, "initial_scale_power": scale_power,
                                              "loss_scale_window": 1, "hysteresis": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model().half()
        return zero_offload.initialize(model, config, groups(model))


def _deepspeed_reads_loss_scaler(path: str) -> tuple[str, float, int, int]:
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  (the class the file names must import)
    scaler = torch.load(path, weights_only=False)["loss_scaler"]
    return type(scaler).__name__, scaler.loss_scale, scaler.cur_iter, scaler.cur_hysteresis


def test_an_fp16_loss_scale_crosses_in_deepspeed_s_own_class(tmp_path):
    """fp16: the dynamic loss scale (scale, iteration, hysteresis) is written as DeepSpeed's DynamicLossScaler,
    which DeepSpeed unpickles as its own, and read back from it."""
    from deepspeed_peer import batches, loss_of
    engine = _fp16_engine()
    try:
        for x in batches(N):
            engine.backward(loss_of(engine, x))
            engine.step()
        saved = engine.state_dict()["loss_scaler"]
        assert saved["scale"] > 2 ** 4                             # the scale grew: it is not the initial one
        engine.save_checkpoint(str(tmp_path / "uc"), format="deepspeed-universal")
    finally:
        engine.close()
    file = tmp_path / "uc" / f"global_step{N}" / "zero" / "optimizer_state.pt"
    name, scale, iteration, hysteresis = run_ranks(_deepspeed_reads_loss_scaler, 1, str(file))[0]
    assert (name, scale, iteration, hysteresis) == ("DynamicLossScaler", saved["scale"], saved["iteration"],
                                                    saved["hysteresis"])
    engine = _fp16_engine(scale_power=10)
    try:
        engine.load_checkpoint(str(tmp_path / "uc"))
        assert engine.state_dict()["loss_scaler"] == saved
    finally:
        engine.close()


def test_a_tampered_or_unmappable_file_is_refused_naming_it(saved, tmp_path):
    """Files from another run, another optimizer, stage 0, or a damaged universal file: each refused before the
    engine changes, naming the file."""
    import shutil
    from deepspeed_peer import make_model
    from zero_offload.checkpoint.foreign_pickle import load_pt, save_pt
    source, _ = saved(2, 2, True)
    path = tmp_path / "ds"
    shutil.copytree(source, path)
    tag = path / f"global_step{N}"
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = load_pt(rank1)
    flats = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    moments = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    good = flats[0].clone()
    flats[0] = torch.zeros(good.numel() + 2)             # moments of another size than the masters
    save_pt(sd, rank1)
    _refused(path, make_model(), rf"file '{rank1}' is damaged: group 0's exp_avg has {good.numel()} elements")
    kept = {k: moments[k] for k in ("exp_avg", "exp_avg_sq")}
    moments.update({k: torch.zeros(good.numel() + 2) for k in kept})     # a partition of another run's size
    save_pt(sd, rank1)
    _refused(path, make_model(), rf"file '{rank1}' holds partitions of \[{good.numel() + 2}, ")
    flats[0] = good
    moments.update(kept)
    del sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"]    # not Adam
    save_pt(sd, rank1)
    _refused(path, make_model(), rf"file '{rank1}' holds optimizer state \['exp_avg', 'step'\]")
    model_states = tag / "mp_rank_00_model_states.pt"
    states = load_pt(model_states)
    states["param_shapes"] = None                          # what DeepSpeed writes without ZeRO
    save_pt(states, model_states)
    _refused(path, make_model(), rf"file '{model_states}' was written without ZeRO")
    universal, _ = saved(3, 2, False, universal=True)
    shutil.copytree(universal, tmp_path / "uc")
    file = tmp_path / "uc" / f"global_step{N}" / "zero" / "transformer.wpe.weight" / "exp_avg.pt"
    file.write_bytes(file.read_bytes()[:100])
    _refused(tmp_path / "uc", make_model(), rf"file '{file}' cannot be read")


def test_the_deepspeed_drop_in_takes_deepspeed_s_load_flags(saved):
    """The drop-in's load_checkpoint(dir, load_module_only=True) loads the weights alone and returns DeepSpeed's
    (path, client_state)."""
    import warnings
    import zero_offload.deepspeed as ds_drop_in
    from deepspeed_peer import make_model
    path, _ = saved(1, 2, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = ds_drop_in.initialize(model=make_model(), config=our_config(2, True))
    try:
        where, client_state = engine.load_checkpoint(path, load_module_only=True)
        assert where.endswith(f"global_step{N}") and client_state == {"epoch": 7}
        assert engine.global_steps == 0                    # counters untouched: weights only
        assert engine.engine.optimizer_state.group_step(0) == 0
    finally:
        engine.engine.close()


def _ds_16bit_save(path: str, stage: int, precision: str) -> dict:
    """DeepSpeed in ``precision`` (bf16 or fp16, initial loss scale 2**8) trains N steps and saves; returns its
    loss scaler's state at the save. DeepSpeed refuses fp16 on its CPU accelerator ("fp16 is not supported"); its
    fp16 optimizer runs on the CPU all the same once the accelerator says it is supported, which is all that is
    patched here: the files are DeepSpeed's own."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed_peer import _deepspeed_engine, batches, ds_config, loss_of, my_half
    get_accelerator().is_fp16_supported = lambda: True
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}
    _, engine = _deepspeed_engine({**ds_config(stage, False), **extra})
    for x in batches(N):
        engine.backward(loss_of(engine, my_half(x, dist.get_rank(), dist.get_world_size())))
        engine.step()
    engine.save_checkpoint(path)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return {} if precision == "bf16" else {"scale": float(scaler.cur_scale), "iteration": int(scaler.cur_iter)}


def _ds_fp32_states(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own reading of a checkpoint: ds_to_universal's per-parameter fp32 master and moments."""
    import glob
    import os
    from deepspeed_peer import to_universal
    to_universal(path)
    out = {}
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        for file in glob.glob(f"{path}-universal/global_step{N}/zero/*/{kind}.pt"):
            saved = torch.load(file, weights_only=False)
            out.setdefault(os.path.basename(os.path.dirname(file)), {})[kind] = saved["param"] if isinstance(
                saved, dict) else saved
    return out


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16bit_deepspeed_checkpoint_loads_bitwise(tmp_path, stage, precision):
    """bf16 and fp16 (DeepSpeed's own files): the fp32 masters and both moments load bitwise as DeepSpeed's own
    converter reads them, into an engine of the same precision on one rank from two, and the step, the counters
    and (fp16) the dynamic loss scale come along."""
    import warnings
    import zero_offload
    from deepspeed_peer import groups, make_model
    from zero_offload.checkpoint.load import full_parameters, read_manifest, resolve_tag
    scaler = run_ranks(_ds_16bit_save, 2, str(tmp_path / "ds"), stage, precision)[0]
    prefix = "bf16_" if precision == "bf16" else ""
    assert list((tmp_path / "ds" / f"global_step{N}").glob(f"{prefix}zero_pp_rank_*_optim_states.pt"))
    theirs = run_ranks(_ds_fp32_states, 1, str(tmp_path / "ds"))[0]
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zero_offload.initialize(model, {**our_config(2, True), precision: {"enabled": True}},
                                         groups(model))
    try:
        engine.load_checkpoint(str(tmp_path / "ds"))
        assert engine.global_step == N and engine.optimizer_state.group_step(0) == N
        if precision == "fp16":
            assert scaler["scale"] == 2.0 ** 9             # one doubling in N = 3 clean steps, window 2
            mine = engine.state_dict()["loss_scaler"]
            assert (mine["scale"], mine["iteration"]) == (scaler["scale"], scaler["iteration"])
        engine.save_checkpoint(str(tmp_path / "ours"))
    finally:
        engine.close()
    directory = resolve_tag(tmp_path / "ours")
    manifest = read_manifest(directory)
    for ours_kind, kind in (("master", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        for name, t in full_parameters(directory, manifest, ours_kind):
            assert torch.equal(t.reshape(-1), theirs[name][kind].reshape(-1).float()), (name, kind)
