"""A TRL trainer with ``deepspeed=config`` in its arguments, unchanged: run under DeepSpeed itself or under
``zero-offload run`` (tests/test_stand_in_scripts.py). DPO builds its reference model with ``deepspeed.initialize``
and no optimizer (TRL's ``prepare_deepspeed``). Writes {losses, deepspeed's file} to OUT and the fp32 weights
(``deepspeed.utils.safe_get_full_fp32_param``) to OUT.weights.pt on rank 0.

    python tests/stand_in_trl.py OUT --trainer dpo --stage 3 --model-dir DIR
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_runs  # noqa: E402
from stand_in_runs import write_out  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--trainer", default="dpo")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model-dir", required=True)
    a = p.parse_args()
    work = os.path.dirname(os.path.abspath(a.out))
    config = trl_runs.zero_config(a.stage)
    del config["train_batch_size"]   # DeepSpeed's zero.Init checks it against a world size of its own: left out
    trainer, losses, _ = trl_runs.run(a.trainer, a.model_dir, os.path.join(work, "trl"), deepspeed=config,
                                      max_steps=4)
    write_out(a.out, losses, trainer.model_wrapped.module, trainer.is_world_process_zero())


if __name__ == "__main__":
    main()
