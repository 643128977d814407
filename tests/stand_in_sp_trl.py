"""TRL's SFTTrainer with Ulysses sequence parallelism (``parallelism_config=ParallelismConfig(sp_backend="deepspeed",
sp_size=2)`` and ``deepspeed=config`` in its arguments), unchanged, on 2 ranks: run under DeepSpeed itself or under
``zero-offload run`` (tests/test_ulysses.py). Writes {losses, deepspeed's file} to OUT and the fp32 weights to
OUT.weights.pt on rank 0.

    python tests/stand_in_sp_trl.py OUT --stage 3 --model-dir DIR
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_runs  # noqa: E402
from stand_in_runs import write_out  # noqa: E402


def main() -> None:
    import deepspeed
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model-dir", required=True)
    a = p.parse_args()
    work = os.path.dirname(os.path.abspath(a.out))
    # accelerate on the CPU leaves DeepSpeed's own comm uninitialised, and DeepSpeed's parallel_state_sp asserts it
    deepspeed.init_distributed(dist_backend="gloo")
    config = trl_runs.zero_config(a.stage)
    del config["train_batch_size"]   # DeepSpeed's zero.Init checks it against a world size of its own: left out
    sp = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    trainer, losses, _ = trl_runs.run("sft", a.model_dir, os.path.join(work, "trl"), deepspeed=config,
                                      parallelism_config=sp, max_steps=3, per_device_train_batch_size=1,
                                      gradient_accumulation_steps=1, max_length=6)
    write_out(a.out, losses, trainer.model_wrapped.module, trainer.is_world_process_zero())


if __name__ == "__main__":
    main()
