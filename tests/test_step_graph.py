"""The step model's timeline (issue 27, item 5; `zero_offload.estimate.step_graph`): the engine's own step, recorded on
a proxy under simulated streams, replayed with a plan's durations, and used by the planner and `zero-offload estimate`.
"""
from __future__ import annotations

import pytest
import torch

import zero_offload
from zero_offload.cli import main
from zero_offload.estimate import step_graph
from zero_offload.estimate.proxy_recording import close_recorder
from zero_offload.estimate.recording_cache import DIR_ENV
from zero_offload.estimate.step_graph import Phases, Structure, predict_step
from zero_offload.offload import buffer_lease


@pytest.fixture(autouse=True)
def _recorded_afresh(monkeypatch):
    """Recordings made here, not read from disk: these tests change the engine or count the recordings."""
    monkeypatch.setenv(DIR_ENV, "off")


PLAIN = Structure(stage=2, offload_param=False, delayed=False, accumulates=False, fp32=False)
DELAYED = Structure(stage=2, offload_param=False, delayed=True, accumulates=False, fp32=False)
# The 10B GPT-2's pinned config on an H200 (BENCHMARKS.md, "GPU runs"): device forward and backward
# 0.60 / 1.59 s, copies 0.37 s down and 0.42 s up, host step 1.79 s (2.02 s on the delayed step's 12 threads).
TEN_B = dict(forward_s=0.60, backward_s=1.59, down_s=0.37, up_s=0.42, add_s=0.0)


def test_the_replay_matches_the_measured_10b_steps():
    """Measured on the H200: 3.89 s without the delayed update, 2.21 s (device idle 2 %) with it."""
    plain = predict_step(PLAIN, Phases(**TEN_B, host_s=1.79))
    delayed = predict_step(DELAYED, Phases(**TEN_B, host_s=2.02))
    assert abs(plain.compute_s - 2.19) < 1e-6 and abs(delayed.compute_s - 2.19) < 1e-6
    # without: the host step follows backward's last copy down, its copies up pipelined behind it
    assert 2.19 + 1.79 <= plain.step_s <= 2.19 + 1.79 + 0.1, plain.lines()
    assert delayed.idle_share <= 0.05, delayed.lines()
    assert delayed.step_s <= 2.19 * 1.03, delayed.lines()
    path = [what for what, _ in plain.critical_path]
    assert path[:2] == ["forward", "backward"] and "host step (training thread)" in path, path
    assert set(delayed.bars) >= {"device compute", "copies down", "copies up", "host step thread"}
    assert all(len(bar) == step_graph.BAR_COLUMNS for bar in delayed.bars.values())


def test_a_delayed_step_longer_than_the_compute_sets_the_step():
    """The delayed step's thread does one host step of work per step: the step is at least that long, and the
    device idles the difference; a faster host hides it."""
    slow = predict_step(DELAYED, Phases(**TEN_B, host_s=3.0))
    assert 3.0 <= slow.step_s <= 3.1 and abs(slow.idle_s - (slow.step_s - 2.19)) < 1e-6
    fast = predict_step(DELAYED, Phases(**TEN_B, host_s=1.0))
    assert fast.step_s < 2.19 * 1.03


def test_accumulation_scales_the_later_micro_steps():
    """A recorded later micro-step stands for the plan's ``gas - 1``: compute is first + (gas - 1) x later."""
    s = Structure(stage=2, offload_param=False, delayed=False, accumulates=True, fp32=False)
    for gas in (2, 5):
        g = predict_step(s, Phases(**{**TEN_B, "add_s": 0.2}, host_s=2.2, gas=gas))
        assert abs(g.compute_s - gas * 2.19) < 1e-6, (gas, g.compute_s)
        assert g.step_s >= gas * 2.19 + 2.2


def test_the_replay_sees_what_the_engine_waits_for(monkeypatch):
    """Power: a lent gradient buffer whose copies down wait for the whole delayed step (its last copy up) instead of
    the copy up that read their own chunk: the replay shows the 10B step's backward waiting for the host step."""
    fine = predict_step(DELAYED, Phases(**TEN_B, host_s=2.02))

    wait = buffer_lease.BufferLease.wait
    monkeypatch.setattr(buffer_lease.BufferLease, "wait", lambda self, lo: wait(self, 0))   # the last release
    step_graph.recording.cache_clear()
    try:
        worse = predict_step(DELAYED, Phases(**TEN_B, host_s=2.02))
    finally:
        step_graph.recording.cache_clear()
    assert worse.step_s > fine.step_s + 0.5, (fine.lines(), worse.lines())


@pytest.mark.parametrize("why", ["distributed", "cuda"])
def test_the_recording_runs_in_a_one_rank_cpu_subprocess_where_needed(monkeypatch, why):
    """Inside a distributed job, and where CUDA is visible (the proxy would take the GPU, whose streams are not
    simulated: on the H200 that recorded no copies and no waits), the proxy records in a subprocess."""
    here = step_graph.recording(PLAIN)
    step_graph.recording.cache_clear()
    if why == "distributed":
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        there = step_graph.recording(PLAIN)
    finally:
        step_graph.recording.cache_clear()
        close_recorder()
    kinds = lambda rec: sorted({(o.lane.split("_")[0], o.kind) for o in rec[0].ops})   # noqa: E731
    assert kinds(here) == kinds(there) and len(here[1]) == len(there[1])
    assert ("h2d", "copy") in kinds(there) and ("d2h", "copy") in kinds(there)


def test_the_planner_and_the_cli_use_the_replayed_step(capsys):
    # The delayed update allowed: the whole optimizer on the host, so the step is the replayed graph alone (a ratio
    # plan adds the device part's step on top of it).
    p = zero_offload.plan("gpt2-10b", gpus=1, gpu_memory="80GB", host_memory="128GB", allow_stale_step=True,
                          allow_bf16_moments=True)
    t = p.batch.timing
    assert t.graph is not None and t.step_s == t.graph.step_s and t.exposed_s == t.graph.idle_s
    assert "recorded step replayed" in p.reasons["step"]
    assert main(["estimate", "--model", "gpt2-10b", "--gpus", "1", "--gpu-mem", "80GB", "--host-mem", "128GB",
                 "--allow-bf16-moments", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    assert "predicted timeline of one step" in out and "critical path (s):" in out
    assert any(line.strip().startswith("device compute") and "|" in line for line in out.splitlines())


def test_no_host_work_no_graph():
    p = zero_offload.plan("gpt2", gpus=1, gpu_memory="80GB", host_memory="64GB", micro_batch=8, gradient_accumulation=1)
    assert p.batch.timing.host_s == 0 and p.batch.timing.graph is None


@pytest.mark.parametrize("bad", [0, -3])
def test_copy_chunk_refuses_a_bad_size(bad):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "copy_chunk": bad}}}
    with pytest.raises(zero_offload.ConfigError, match="offload_optimizer.copy_chunk"):
        zero_offload.Config.load(cfg)


def test_forced_simulation_is_not_nested():
    from zero_offload.offload import simulated
    with simulated.forced():
        assert simulated.enabled() and not simulated.waits_skipped()
        with pytest.raises(RuntimeError, match="simulated.forced is already active"):
            with simulated.forced():
                pass


def test_gpu_validate_prints_the_replayed_step_beside_the_measured_one():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpu_report
    g = predict_step(DELAYED, Phases(**TEN_B, host_s=2.02))
    predicted = {"timeline": g.lines(), "compute_s": g.compute_s, "idle_share": g.idle_share, "busy": g.busy,
                 "step_s": g.step_s}
    timings = {"device_forward_s": 0.6, "device_backward_s": 1.59, "host_step_s": 2.02}
    measured = {"step_s": 2.21, "device_idle_share": 0.02, "timings": timings,
                "copies": {"h2d": {"s": 0.46}, "d2h": {"s": 0.40}}}
    text = "\n".join(gpu_report._timeline(predicted, measured))
    assert "| step s | " in text and "| 2.210 |" in text and "| host step s | 2.020 | 2.020 |" in text
    assert "host step thread |" in text and "critical path (s):" in text
    assert gpu_report._timeline({}, measured) == []


def test_recording_leaves_the_callers_random_state_and_warnings_alone():
    """The planner records inside a user's process (the main job plans before it builds its model)."""
    import torch
    import warnings
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    step_graph.recording.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step_graph.recording(PLAIN)
    finally:
        step_graph.recording.cache_clear()
    assert torch.equal(torch.rand(3), expected) and not caught, [str(w.message) for w in caught]


def _bytes_down_after_backward(s: Structure) -> float:
    """The share of the boundary micro-step's gradient bytes copied down after its last backward op (the tail
    the host step of an exact step waits for)."""
    tl, marks = step_graph.recording(s)
    start, end = marks[1][0], marks[2][0]            # the second recorded step (its only micro-step)
    ops = [o for o in tl.ops if start <= o.id < end]
    last_backward = max(o.id for o in ops if o.kind == "backward")
    down = [o for o in ops if o.lane == "d2h" and o.kind == "copy"]
    return sum(o.work for o in down if o.id > last_backward) / sum(o.work for o in down)


def test_the_first_unit_lands_last_as_gpt2s_tied_embedding_does():
    """GPT-2's embedding (tied to its head: 31 % of GPT-2 124M) is the last gradient backward completes, so its
    copy down and host step cannot start before backward ends. The proxy holds that share in a tied first unit:
    that share of the gradient comes down after backward, where the bare proxy's equal layers leave 1/16;
    and super_offload's speculated step, which waits for it, leaves more of the step exposed."""
    shares = [step_graph.first_unit_share(zero_offload.estimate.model_shape(m)) for m in ("gpt2", "gpt2-xl",
                                                                                         "gpt2-10b")]
    assert shares == [5 / 16, 0.0, 0.0]          # XL's 5.2 % and the 10B's 2 %: the bare proxy's 1/16 stands for them
    assert step_graph.first_unit_share(zero_offload.estimate.model_shape(10 ** 9)) == 0.0     # a bare count
    tied = Structure(stage=2, offload_param=False, delayed=False, accumulates=False, fp32=False, first_unit=5 / 16)
    # the embedding's share, and the first block's (its copy down follows its backward, the last compute op)
    assert abs(_bytes_down_after_backward(tied) - (5 / 16 + 11 / 16 / 16)) < 0.005
    assert abs(_bytes_down_after_backward(PLAIN) - 1 / 16) < 0.005
    phases = Phases(**TEN_B, host_s=1.79)
    spec = dict(stage=2, offload_param=False, delayed=False, accumulates=False, fp32=False, speculative=True)
    bare, embedded = (predict_step(Structure(**spec, first_unit=f), phases) for f in (0.0, 5 / 16))
    assert embedded.idle_s > bare.idle_s + 0.2 * 1.79, (bare.lines(), embedded.lines())


def test_the_planner_records_the_models_first_unit(monkeypatch):
    """The planner's step for GPT-2 124M comes from a proxy with its embedding's share, not the bare one."""
    from zero_offload.estimate import batching
    seen = []
    monkeypatch.setattr(batching, "predict_step", lambda s, p: seen.append(s) or predict_step(s, p))
    p = zero_offload.plan("gpt2", gpus=1, gpu_memory="8GB", host_memory="64GB", micro_batch=4, seq_len=1024,
                          gradient_accumulation=1, config={"zero_optimization": {"stage": 2, "offload_optimizer":
                                                                                 {"device": "cpu"}}})
    assert p.batch.timing is not None and seen
    assert {s.first_unit for s in seen} == {5 / 16}


def test_an_untied_head_is_its_own_last_unit_in_a_config_file_shape(tmp_path):
    """``--hf-config``: an untied head is the last unit, as the module order puts it (its gradient lands first), not
    part of the first: Llama 3 8B's first unit is its embedding alone (6.5 %: the bare proxy), as for the module."""
    import json

    from zero_offload.estimate.table import hf_config_shape
    cfg = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = hf_config_shape(str(tmp_path / "config.json"))
    assert shape.units[0] == ("embed", 0, (128256 * 4096,)) and shape.units[-1] == ("lm_head", 0, (128256 * 4096,))
    assert step_graph.first_unit_share(shape) == 0.0
