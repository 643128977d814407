"""The planner at long sequences: the step model counts attention's FLOPs, the tiles' recompute and Ulysses'
all-to-alls (`zero_offload.estimate.sequence_compute`), and `plan_sequence` (``zero-offload estimate --hf-config
--seq-len``) chooses the Ulysses size, tiled compute and checkpointing by it."""
import json

import pytest

from zero_offload.cli import main
from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.estimate.planner import plan
from zero_offload.estimate.sequence_compute import attention_params, tiled_recompute_params, ulysses_seconds
from zero_offload.estimate.sequence_plan import plan_sequence
from zero_offload.estimate.table import hf_config_shape
from zero_offload.estimate.throughput import Assumptions

LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "head_dim": 128}
FIXED = dict(micro_batch=1, gradient_accumulation=1, activation_checkpointing=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    return hf_config_shape(str(path)), str(path)


def test_the_terms_follow_their_formulas(llama):
    shape, _ = llama
    assert attention_params(shape, 1000) == 32 * 4096 * 1000                 # L q s
    assert tiled_recompute_params(shape, SequenceTiles(loss=2, mlp=3)) == 32 * 3 * 4096 * 14336 + 128256 * 4096
    assert tiled_recompute_params(shape, None) == 0 and ulysses_seconds(shape, 1000, 1, 2, True, 1e11) == 0.0
    # q, k, v and the output, (2q + 2kv) x d x t x (P - 1) / P per block, three passes with checkpointing
    assert ulysses_seconds(shape, 1000, 4, 2, True, 1e11) == pytest.approx(
        3 * 32 * 2 * 1000 * (2 * 4096 + 2 * 1024) * 0.75 / 1e11)


def test_a_longer_sequence_costs_more_per_token(llama):
    """Power test of the attention term: at the same tokens per micro-step, a step of one 64K sequence is slower
    than one of eight 8K ones by attention's 6 L q s per token (8 with the recompute); without the term the two
    would be equal."""
    shape, _ = llama
    tiles = SequenceTiles(loss=64, mlp=8, norms=4)
    long = plan(shape, 1, "80GB", "256GiB", seq_len=65536, **FIXED, tiles=tiles)
    short = plan(shape, 1, "80GB", "256GiB", seq_len=8192, **{**FIXED, "micro_batch": 8}, tiles=tiles)
    n, r = shape.n_params, tiled_recompute_params(shape, tiles)

    def flops(s):
        return 8 * (n + attention_params(shape, s)) + 2 * r
    assert long.batch.timing.micro_s / short.batch.timing.micro_s == pytest.approx(flops(65536) / flops(8192),
                                                                                   rel=0.01)


def test_tiles_and_ulysses_add_their_time(llama, monkeypatch):
    """Power tests: the tiles' recompute lengthens the predicted micro-step by 2 t FLOPs per MLP parameter; a slower
    interconnect lengthens a Ulysses step by exactly its all-to-alls' extra time."""
    import zero_offload.estimate.planner as planner
    shape, _ = llama
    head, both = SequenceTiles(loss=16), SequenceTiles(loss=16, mlp=4, norms=2)
    plans = {t: plan(shape, 8, "80GB", "2TB", seq_len=65536, **FIXED, tiles=t) for t in (head, both)}
    flops = Assumptions().gpu_flops
    extra = 2 * (tiled_recompute_params(shape, both) - tiled_recompute_params(shape, head)) * 65536 / flops
    assert plans[both].batch.timing.micro_s - plans[head].batch.timing.micro_s == pytest.approx(extra, rel=1e-6)
    config = dict(plans[both].config, sequence_parallel_size=8)
    fast = plan(shape, 8, "80GB", "2TB", seq_len=65536, **FIXED, config=config, tiles=both)
    monkeypatch.setattr(planner, "calibrated", lambda _=None: Assumptions(interconnect=1e9))
    slow = plan(shape, 8, "80GB", "2TB", seq_len=65536, **FIXED, config=config, tiles=both)
    gap = ulysses_seconds(shape, 8192, 8, 2, True, 1e9) - ulysses_seconds(shape, 8192, 8, 2, True, 300e9)
    assert slow.batch.timing.micro_s - fast.batch.timing.micro_s == pytest.approx(gap, rel=1e-6)
    assert fast.batch.timing.micro_s < plans[both].batch.timing.micro_s       # 8K tokens per rank, not 64K


def test_plan_sequence_chooses_ulysses_tiles_and_checkpointing(llama):
    """The fastest that fits among the Ulysses sizes, tiles and checkpointing: on one GPU at 128K tokens only the
    tiled, checkpointed plan fits; on 8 GPUs the choice is at least as fast as each size's own plan, and a size the
    config sets is kept."""
    shape, _ = llama
    one = plan_sequence(shape, 1, "80GB", "256GiB", seq_len=131072)
    assert one.fits and one.batch.checkpointing and "tiled" in one.reasons["sequence"]
    assert "gradient_checkpointing_enable" in one.reasons["sequence"]
    eight = plan_sequence(shape, 8, "80GB", "2TB", seq_len=131072)
    assert "Ulysses sequence_parallel_size 8" in eight.reasons["sequence"]
    base = dict(eight.config, sequence_parallel_size=8)
    base.pop("activation_checkpointing", None)
    for tiles in (None, SequenceTiles(loss=24, mlp=3, norms=2)):
        alone = plan(shape, 8, "80GB", "2TB", seq_len=131072, config=base, tiles=tiles, activation_checkpointing=True)
        if alone.fits:
            assert eight.batch.timing.tokens_per_s >= alone.batch.timing.tokens_per_s
    kept = plan_sequence(shape, 8, "80GB", "2TB", seq_len=131072, config=dict(eight.config, sequence_parallel_size=2))
    assert kept.config["sequence_parallel_size"] == 2


def test_the_cli_says_what_it_chose(llama, capsys):
    _, path = llama
    assert main(["estimate", "--hf-config", path, "--gpus", "8", "--gpu-mem", "80GB", "--host-mem", "2TB",
                 "--seq-len", "131072", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    assert "sequence: " in out and "the fastest that fits" in out and "tried " in out


def test_cpu_layers_copies_are_charged_beside_compute(llama):
    """Power test: the second mode's copies (``cpu_layers``: whole blocks' activations in host memory) cost their
    PCIe time beyond the forward and the backward they overlap, as the checkpoint inputs' do; without the charge
    the two steps would be equal."""
    from zero_offload.estimate.checkpoint_modes import input_copy_exposure
    shape, _ = llama
    fixed = dict(micro_batch=1, gradient_accumulation=1, activation_checkpointing=False, seq_len=8192, pcie=1e9)
    plain = plan(shape, 1, "141GB", "512GiB", **fixed)
    config = dict(plain.config, activation_checkpointing={"cpu_layers": 4})
    moved = plan(shape, 1, "141GB", "512GiB", **fixed, config=config)
    layer_bytes = moved.batch.estimate.host["layer_activations"]
    n = shape.n_params + attention_params(shape, 8192)
    flops = Assumptions().gpu_flops
    extra = sum(input_copy_exposure(layer_bytes, 1e9, 2 * n * 8192 / flops, 4 * n * 8192 / flops))
    assert extra > 0
    assert moved.batch.timing.micro_s - plain.batch.timing.micro_s == pytest.approx(extra, rel=1e-6)


def test_the_planner_moves_the_fewest_whole_blocks_where_the_device_is_short(llama):
    """A decoder not checkpointed whose activations the device cannot hold: the plan moves the fewest first blocks'
    activations to host memory (``cpu_layers``, the second mode) that make it fit, their bytes counted on the host and
    their copies in the step; one block fewer does not fit. Here that beats recomputing every block."""
    shape, _ = llama
    box = dict(gpus=1, gpu_memory="141GB", host_memory="512GiB", seq_len=16384, micro_batch=1)
    chosen = plan(shape, **box, activation_checkpointing=False)
    n = chosen.config["activation_checkpointing"]["cpu_layers"]
    est = chosen.batch.estimate
    assert n >= 1 and est.host["layer_activations"] == n * est.block_activation_bytes
    assert f"the first {n} blocks keep their activations in host memory" in chosen.reasons["activation_checkpointing"]
    fewer = dict(chosen.config, activation_checkpointing={"cpu_layers": n - 1})
    assert not plan(shape, **box, activation_checkpointing=False, config=fewer).fits
    recomputed = plan(shape, **box, activation_checkpointing=True)
    assert chosen.batch.timing.tokens_per_s > recomputed.batch.timing.tokens_per_s
