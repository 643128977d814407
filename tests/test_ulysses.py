"""Ulysses sequence parallelism (issue 58, item 3): DeepSpeed's ALST call sequence under the engine, exact against
plain AdamW on one process over the same global batch; the HF Trainer's own sequence-parallel path under the
stand-in, against DeepSpeed 0.19.8 itself; and the errors for what cannot work.

The runs (`sp_runs.run`): register Ulysses with transformers, build the model, initialize (ours or
``deepspeed.initialize(mpu=...)``), wrap the loader in ``UlyssesSPDataLoaderAdapter``, and train with each shard's loss
combined over the group: `Engine.sequence_parallel_loss` (the token-weighted mean, exact at every stage) or the
tutorial's differentiable all-gather (exact at stage 3; at stages 0-2 it yields the group size times the gradient,
under DeepSpeed 0.19.8 as here, because torch's all-gather sums the gradients of every rank's copy).
"""
import importlib.util
import warnings

import pytest
import torch

import sp_runs
from dist_utils import run_ranks

pytest.importorskip("transformers")
TOL = 1e-5


def _cases(cases, tmp):
    return [sp_runs.run(*case[:3], "cpu", *case[3:5], steps=1 if case[5] == "save" else sp_runs.STEPS,
                        save=f"{tmp}/ckpt" if case[5] == "save" else None,
                        load=f"{tmp}/ckpt" if case[5] == "load" else None, checkpointing=case[5] == "ckpt",
                        tiled=case[5] == "tiled")
            for case in cases]


# (shape, stage, sequence-parallel size, loss, through deepspeed.initialize(mpu=...), checkpoint)
TWO = [("llama", 2, 2, "engine", False, None), ("llama", 3, 2, "engine", False, None),
       ("llama", 2, 2, "engine", False, "save"), ("llama", 3, 1, "engine", False, "load"),
       ("qwen", 3, 2, "alst", True, None), ("llama", 2, 2, "alst", True, None),
       ("llama", 3, 2, "engine", False, "tiled")]
FOUR = [("llama", 3, 4, "engine", False, None), ("qwen", 2, 2, "engine", False, "ckpt")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERO_OFFLOAD_TIMEOUT_S", "120")
        return run_ranks(_cases, 2, TWO, str(tmp_path_factory.mktemp("sp2")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERO_OFFLOAD_TIMEOUT_S", "120")
        return run_ranks(_cases, 4, FOUR, str(tmp_path_factory.mktemp("sp4")))


def _assert_matches_adamw(results, case: int, shape: str, world: int, sp: int) -> None:
    ref, ref_losses = sp_runs.reference(shape, world)
    for rank, runs in enumerate(results):
        run = runs[case]
        gap = max((run["params"][n] - v).abs().max().item() for n, v in ref.items())
        assert gap <= TOL, (rank, gap)
        # each micro-step's loss is one sample's; a step's mean over its world samples is the reference loss
        steps = [sum(run["losses"][k * sp:(k + 1) * sp]) / sp for k in range(len(run["losses"]) // sp)]
        if sp == world:
            assert steps == pytest.approx(ref_losses[-len(steps):], abs=TOL)


TWO_IDS = ["llama-stage2-engine-loss", "llama-stage3-engine-loss", "qwen-kv1-stage3-alst-loss-deepspeed-face",
           "llama-stage3-tiled-mlp-and-norms"]


@pytest.mark.parametrize("case", [0, 1, 4, 6], ids=TWO_IDS)
def test_two_rank_sequence_parallel_matches_adamw(two_ranks, case):
    """Size 2 on 2 ranks with the optimizer offloaded trains the same global batch as AdamW on one process to
    1e-5: Llama (4 heads, 2 key/value heads) at stages 2 and 3, Qwen2 with one key/value head (replicated to each
    rank) at stage 3 through ``deepspeed.initialize(mpu=...)`` with the tutorial's loss, and Llama with every MLP
    and RMSNorm sequence-tiled (``TiledMLP``, `tile_rms_norms`, 2 tiles of each shard) at stage 3."""
    shape, _, sp, *_ = TWO[case]
    _assert_matches_adamw(two_ranks, case, shape, 2, sp)


def test_a_checkpoint_saved_at_size_two_resumes_at_size_one(two_ranks):
    """Saved after step 1 at sequence-parallel size 2 and stage 2, loaded at size 1 and stage 3 (plain data
    parallelism, same ranks): step 2 lands on AdamW's parameters after 2 steps."""
    _assert_matches_adamw(two_ranks, 3, "llama", 2, 1)
    assert len(two_ranks[0][2]["losses"]) == 2 and len(two_ranks[0][3]["losses"]) == 1


def test_the_tutorial_loss_at_stage_two_gives_the_group_size_times_the_gradient(two_ranks):
    """As under DeepSpeed 0.19.8 (measured: a gradient norm ratio of 2.0 at stage 2, 1.0 at stage 3): the engine
    follows DeepSpeed's average, the tutorial's loss doubles each rank's share."""
    exact, tutorial = two_ranks[0][0]["norms"], two_ranks[0][5]["norms"]
    assert tutorial[0] == pytest.approx(2 * exact[0], rel=1e-5)


@pytest.mark.parametrize("case", [0, 1], ids=["llama-kv2-size4-stage3", "qwen-size2-dp2-stage2-checkpoints-on-host"])
def test_four_rank_sequence_parallel_matches_adamw(four_ranks, case):
    """4 ranks: size 4 at stage 3 (Llama's 2 key/value heads replicated to 4; accumulation 4) and size 2 with 2
    data-parallel replicas at stage 2 (the gradient averaged over the replicas, summed over the group) with
    transformers' activation checkpointing, ``offload=True``: the block inputs of every shard in host memory."""
    shape, _, sp, *_ = FOUR[case]
    _assert_matches_adamw(four_ranks, case, shape, 4, sp)
    if FOUR[case][5] == "ckpt":
        assert all(runs[case]["offloaded"] > 0 for runs in four_ranks)


# -- the HF Trainer's own path (accelerate's ParallelismConfig) against DeepSpeed itself --------------------------
def _against_deepspeed(tmp_path, script: str, *args) -> None:
    from stand_in_runs import assert_agree, launch
    runs = []
    for ours in (True, False):
        (tmp_path / str(ours)).mkdir()
        runs.append(launch(script, ours, tmp_path / str(ours), 2, *args))
    assert_agree(*runs, steps=3)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed (the peer) is not installed")
def test_hf_trainer_sequence_parallel_trains_as_deepspeed(tmp_path):
    """``TrainingArguments(deepspeed=..., parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))``
    under ``zero-offload run`` and under DeepSpeed 0.19.8 (CPU accelerator), Llama at stage 3 with the optimizer
    offloaded: the same losses, weights within 1e-5 (measured 6e-7; Qwen2 at stage 2 measured 1e-7 too).
    transformers computes the loss itself (``deepspeed_sp_compute_loss``) for DeepSpeed's gradient average."""
    _against_deepspeed(tmp_path, "stand_in_sp_trainer.py", "--shape", "llama", "--stage", "3", "--offload")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed (the peer) is not installed")
def test_trl_sft_sequence_parallel_trains_as_deepspeed(tmp_path):
    """TRL's SFTTrainer with the same ``parallelism_config``, stage 2 with the optimizer offloaded, under
    ``zero-offload run`` and under DeepSpeed 0.19.8: the same losses, weights within 1e-5 (measured 1e-7). TRL
    asks the model for its own loss (``fused_lm_head``) and the Trainer reduces it over the group."""
    import trl_runs
    model_dir = trl_runs.save_model_dir(tmp_path / "model")
    _against_deepspeed(tmp_path, "stand_in_sp_trl.py", "--stage", "2", "--model-dir", model_dir)


# -- what cannot work is refused, naming what is at fault --------------------------------------------------------
def test_a_size_that_does_not_divide_the_world_names_the_key():
    import zero_offload
    from toy_model import make_model
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match="sequence_parallel_size = 2 must be a positive divisor of the world size 1"):
        zero_offload.initialize(make_model(), config)


def test_heads_that_do_not_divide_the_size_are_refused():
    from zero_offload.sequence import UlyssesSPAttentionHF
    with pytest.raises(ValueError, match="attention head count 6 is not divisible by the sequence-parallel size 4"):
        UlyssesSPAttentionHF(None, 1, 6, 8, 6, 2, None, True, world_size=4)
    with pytest.raises(ValueError, match="key/value head count 3 is not divisible"):
        UlyssesSPAttentionHF(None, 1, 8, 8, 3, 2, None, True, world_size=4)


@pytest.mark.parametrize("impl, match", [("eager", "needs a dense 4-D attention mask"),
                                         ("no_such_attention", "not an attention implementation"),
                                         ("flash_attention_2", "does not match the model's attn_implementation")])
def test_register_refuses_an_attention_it_cannot_wrap(impl, match):
    from zero_offload.sequence import UlyssesSPAttentionHF
    with pytest.raises(ValueError, match=match):
        UlyssesSPAttentionHF.register_with_transformers(sp_runs.make_model("llama"), impl, 2, 1)


def test_the_adapter_needs_position_ids_and_names_the_key():
    from zero_offload.sequence import UlyssesSPDataLoaderAdapter
    batch = sp_runs.sample(0)
    del batch["position_ids"]
    with pytest.raises(ValueError, match="every batch needs position_ids"):
        next(UlyssesSPDataLoaderAdapter([batch], 0, None, 2, "cpu"))


def test_an_mpu_with_groups_not_made_here_is_refused():
    from zero_offload.compat.mpu import check_mpu

    class ForeignMpu:
        def get_sequence_parallel_world_size(self):
            return 2

        def get_sequence_parallel_group(self):
            return object()

    with pytest.raises(ValueError, match="get_sequence_parallel_world_size\\(\\) = 2, but its groups are not"):
        check_mpu(ForeignMpu())


def test_the_exchange_is_its_own_inverse_at_size_one_and_keeps_gradients():
    from zero_offload.sequence.exchange import gather_sequence, scatter_sequence
    x = torch.randn(2, 4, 6, 8, requires_grad=True)
    y = scatter_sequence(gather_sequence(x, None, 1), None, 1)
    assert y is x


# -- zero-offload's own GPT and main job -------------------------------------------------------------------------
def _train(tmp_path, name: str, world: int, *flags: str) -> list:
    import json
    import os
    import subprocess
    import sys
    from dist_utils import _free_port
    out = tmp_path / name
    launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={_free_port()}", "-m", "zero_offload"] if world > 1 else
              [sys.executable, "-m", "zero_offload"])
    cmd = [*launch, "train", "--steps", "3", "--eval-every", "3", "--save-every", "3", "--seq-len", "64",
           "--tokenizer", "bytes", "--out", str(out), *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_OFFLOAD_SIMULATE")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_main_job_with_sequence_parallel_two_trains_as_one_rank(tmp_path):
    """``zero-offload train --sequence-parallel 2`` on 2 ranks (one replica: both ranks share each sequence, GPT's
    attention cores wrapped from outside, positions offset per shard) gives the one-rank run's losses to 1e-5."""
    one = _train(tmp_path, "one", 1)
    two = _train(tmp_path, "two", 2, "--sequence-parallel", "2")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        key = "loss" if "loss" in a else "val_loss"
        assert b[key] == pytest.approx(a[key], abs=TOL), (a, b)


def test_the_gpt_core_refuses_heads_that_do_not_divide():
    from zero_offload.sequence.gpt import make_sequence_parallel
    from zero_offload.sequence.groups import SequenceParallelGroups
    from zero_offload.train.model import GPT, preset
    model = GPT(preset("tiny"))
    with pytest.raises(ValueError, match="head count \\(4\\) divisible by the sequence-parallel size \\(3\\)"):
        make_sequence_parallel(model, SequenceParallelGroups(3, 3, 0))


# -- the memory model --------------------------------------------------------------------------------------------
def _saved_under_sequence_parallel(kind: str, kv: int):
    """This rank's bytes autograd saves (unique storages, parameters excluded) for one forward of its shard, and the
    memory model's count (`decoder_saved_bytes` at the local length plus Ulysses' terms)."""
    import torch.distributed as dist
    import transformers
    from test_decoder_activations import _saved
    from zero_offload.estimate.decoder_activations import decoder_saved_bytes, decoder_shape
    from zero_offload.estimate.sequence_activations import decoder_sequence_parallel_extra
    from zero_offload.sequence import UlyssesSPAttentionHF
    from zero_offload.sequence.hf_registration import unregister_from_transformers
    cfg = getattr(transformers, kind + "Config")(vocab_size=512, hidden_size=64, intermediate_size=160,
                                                 num_attention_heads=4, num_key_value_heads=kv, num_hidden_layers=2,
                                                 max_position_embeddings=1024, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = getattr(transformers, kind + "ForCausalLM")(cfg).float().train()
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2)
    b, s, rank = 2, 64, dist.get_rank()
    ids = torch.randint(0, 512, (b, s))[:, rank * 32:(rank + 1) * 32]
    seen = {}
    try:
        _saved(model, lambda: model(input_ids=ids, labels=ids,
                                    position_ids=torch.arange(rank * 32, (rank + 1) * 32)[None].expand(b, -1)), seen)
    finally:
        unregister_from_transformers("sdpa")
    m = decoder_shape(cfg)
    predicted = decoder_saved_bytes(m, b, s // 2, 4) + decoder_sequence_parallel_extra(m, b, s, 4, 2, False)
    return sum(t.untyped_storage().nbytes() for t in seen.values()), predicted


@pytest.mark.parametrize("kind, kv", [("Llama", 2), ("Qwen2", 1)])
def test_saved_activation_bytes_under_sequence_parallel_match_the_model_to_the_byte(kind, kv):
    """2 ranks of one group, fp32, b=2, s=64: each rank's saved bytes equal the memory model's exactly; with one
    key/value head (replicated to both ranks) the replicated keys and values are counted too."""
    for measured, predicted in run_ranks(_saved_under_sequence_parallel, 2, kind, kv):
        assert measured == predicted


def test_the_memory_model_and_longest_count_sequence_parallel_ranks():
    """``sequence_parallel_size`` P in the config: a rank's activations are those of s/P positions plus Ulysses'
    terms; ``--longest`` on 8 ranks tries each size and takes the longest (a decoder's logits bound it per rank)."""
    from zero_offload.estimate import estimate_memory
    from zero_offload.estimate.longest import longest, sequence_parallel_sizes
    from zero_offload.estimate.memory import model_shape
    shape = model_shape(sp_runs.make_model("llama"))
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}}
    one = estimate_memory(shape, base, 2, seq_len=4096).device["activations"]
    two = estimate_memory(shape, {**base, "sequence_parallel_size": 2}, 2, seq_len=4096).device["activations"]
    assert one / 2 < two < one
    assert sequence_parallel_sizes(shape, 8) == [1, 2, 4]          # 4 heads, 2 key/value heads
    at_one = longest(shape, 1, "1GB", "64GB")
    at_four = longest(shape, 4, "1GB", "64GB")
    assert at_four.sequence_parallel == 4 and at_four.seq_len > 3 * at_one.seq_len


def test_a_size_without_ulysses_attention_warns_naming_the_key():
    """``sequence_parallel_size`` 2 on a model whose attention is not Ulysses' (a GPT whose cores are not wrapped):
    each rank would attend within its shard only; the engine warns, naming the key (checked at one rank through the
    warning's own rule: the groups of 2 cannot be made on one process)."""
    from zero_offload.sequence.check import warn_if_not_sequence_parallel
    from zero_offload.sequence.gpt import make_sequence_parallel
    from zero_offload.sequence.groups import SequenceParallelGroups
    from zero_offload.train.model import GPT, preset
    model = GPT(preset("tiny"))
    with pytest.warns(UserWarning, match="'sequence_parallel_size' = 2, but the model's attention is not sequence"):
        warn_if_not_sequence_parallel(model, 2)
    make_sequence_parallel(model, SequenceParallelGroups(2, 2, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_not_sequence_parallel(model, 2)                    # wrapped: no warning
    with pytest.warns(UserWarning, match="not sequence parallel"):
        warn_if_not_sequence_parallel(sp_runs.make_model("llama"), 2)   # sdpa, not registered


def _adapter_shards():
    import torch.distributed as dist
    from zero_offload.sequence import UlyssesSPDataLoaderAdapter, initialize
    rank = dist.get_rank()
    length = 8 if rank == 0 else 12                  # the ranks' batches differ in length
    ids = torch.arange(100 * rank, 100 * rank + length)[None]
    batch = {"input_ids": ids, "position_ids": torch.arange(length)[None], "labels": ids.clone(), "tag": f"r{rank}"}
    groups = initialize(2)
    loader = UlyssesSPDataLoaderAdapter([batch], groups.get_sequence_parallel_rank(), groups.group, 2, "cpu")
    return [next(loader) for _ in range(2)], len(loader)


def test_the_adapter_shares_batches_of_different_lengths():
    """Each rank's batch (8 and 12 tokens: DeepSpeed 0.19.8's adapter cannot gather those on gloo) is split in
    group-rank order: step i gives every rank its half of rank i's batch, labels shifted over the whole sequence
    first (the last position has none), non-tensor values shared as they are."""
    results = run_ranks(_adapter_shards, 2)
    for rank, (shards, length) in enumerate(results):
        assert length == 2
        for source, shard in enumerate(shards):
            n = 8 if source == 0 else 12
            half = n // 2
            ids = torch.arange(100 * source, 100 * source + n)
            mine = slice(rank * half, (rank + 1) * half)
            assert torch.equal(shard["input_ids"][0], ids[mine])
            assert torch.equal(shard["position_ids"][0], torch.arange(n)[mine])
            shifted = torch.cat([ids[1:], torch.tensor([-100])])
            assert torch.equal(shard["shift_labels"][0], shifted[mine]) and "labels" not in shard
            assert shard["tag"] == f"r{source}"
