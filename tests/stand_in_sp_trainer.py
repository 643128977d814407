"""transformers' Trainer with Ulysses sequence parallelism, unchanged: ``TrainingArguments(deepspeed=config,
parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))`` on 2 ranks, run under DeepSpeed itself or
under ``zero-offload run`` (tests/test_ulysses.py). Writes {losses, deepspeed's file} to OUT and the fp32 weights to
OUT.weights.pt on rank 0.

    python tests/stand_in_sp_trainer.py OUT --shape llama|qwen --stage 2|3 [--offload]
"""
import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_runs import training_args, zero_config  # noqa: E402
from sp_runs import SEQ, make_model, sample  # noqa: E402
from stand_in_runs import write_out  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """`sp_runs.sample`'s sequences, each with its position_ids (Ulysses needs them)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {k: v[0] for k, v in sample(i).items()}


def main() -> None:
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="llama")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--offload", action="store_true")
    a = p.parse_args()
    work = os.path.dirname(os.path.abspath(a.out))
    import deepspeed
    # accelerate on the CPU leaves DeepSpeed's own comm uninitialised, and DeepSpeed's parallel_state_sp asserts it
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(a.shape)     # before the arguments: at stage 3 they would build it under zero.Init
    sp = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=SEQ, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    args = training_args(os.path.join(work, "trainer"), deepspeed=zero_config(a.stage, offload_optimizer=a.offload),
                         parallelism_config=sp, max_steps=3, per_device_train_batch_size=1,
                         gradient_accumulation_steps=1, max_grad_norm=0.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    write_out(a.out, losses, trainer.model_wrapped.module, trainer.is_world_process_zero())


if __name__ == "__main__":
    main()
