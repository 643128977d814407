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
