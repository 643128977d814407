"""``zero-offload estimate --longest``: the longest sequence a model trains at on one machine, with its plan."""
from zero_offload.cli import main
from zero_offload.estimate.longest import STEP, longest
from zero_offload.estimate.planner import plan
from zero_offload.estimate.shape import model_shape

BOX = dict(gpus=1, gpu_memory="4GB", host_memory="32GiB")


def _fits(seq: int) -> bool:
    return plan(model_shape("gpt2"), micro_batch=1, gradient_accumulation=1, seq_len=seq, activation_checkpointing=True,
                timed=False, **BOX).fits


def test_the_longest_fits_and_one_step_more_does_not():
    found = longest(model_shape("gpt2"), BOX["gpus"], BOX["gpu_memory"], BOX["host_memory"])
    assert found.seq_len % STEP == 0 and found.seq_len > 1024
    assert _fits(found.seq_len) and not _fits(found.seq_len + STEP)
    assert found.plan.fits and found.plan.batch.micro >= 1
    assert found.lines()[0].startswith(f"longest sequence that trains: {found.seq_len:,} tokens")
    # more device memory never trains a shorter sequence
    assert longest(model_shape("gpt2"), 1, "8GB", BOX["host_memory"]).seq_len >= found.seq_len


def test_the_cli_prints_it_and_refuses_two_questions(capsys):
    assert main(["estimate", "--model", "gpt2", "--gpus", "1", "--gpu-mem", "4GB", "--host-mem", "32GiB",
                 "--longest", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("longest sequence that trains: ") and "plan: " in out
    assert main(["estimate", "--gpu-mem", "4GB", "--host-mem", "32GiB", "--longest", "--largest"]) != 0
    assert "give one of --largest" in capsys.readouterr().err
    assert main(["estimate", "--model", "gpt2-10b", "--gpus", "1", "--gpu-mem", "1GB", "--host-mem", "8GiB",
                 "--longest"]) == 1
    assert "not even 1,024 tokens fit" in capsys.readouterr().out


LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "head_dim": 128}


def test_a_decoder_counts_tiled_compute_and_sequence_parallel_ranks(tmp_path):
    """For a decoder the tiled loss, MLPs and norms (`SequenceTiles`, as many tiles as keep each under 1 GiB) lift the
    head's bound, and 8 ranks take Ulysses at the size that trains the longest: each step longer than the last
    (predictions for Llama-3-8B on 80 GB devices and a 256 GiB host; docs/long-sequences.md has the figures)."""
    import json
    from zero_offload.estimate.table import hf_config_shape
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    shape = hf_config_shape(str(path))
    whole = longest(shape, 1, "80GB", "256GiB", tiled=False)
    tiled = longest(shape, 1, "80GB", "256GiB")
    ranks = longest(shape, 8, "80GB", "256GiB")
    assert whole.tiles is None and tiled.tiles.loss > 1 and tiled.tiles.mlp > 1 and tiled.tiles.norms > 1
    assert whole.seq_len < tiled.seq_len < ranks.seq_len and ranks.sequence_parallel == 8
    assert "TiledFusedLogitsLoss" in tiled.lines()[0] and "sequence_parallel_size 8" in ranks.lines()[0]
    # attention's FLOPs (6 L q s per token) dwarf the 6N at these lengths: the predicted speed counts them, and the
    # all-to-alls of Ulysses (sequence_compute); a longer sequence is slower per token
    assert tiled.attention_share > 5 and "attention" in tiled.lines()[0] and "tokens/s" in tiled.lines()[0]
    assert whole.attention_share < tiled.attention_share
    speed = {r.seq_len: r.plan.batch.timing.tokens_per_s for r in (whole, tiled)}
    assert speed[tiled.seq_len] < speed[whole.seq_len]
    assert ranks.plan.batch.timing.tokens_per_s > 0
