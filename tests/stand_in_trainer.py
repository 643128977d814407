"""transformers' Trainer with ``TrainingArguments(deepspeed=config)``, unchanged: run under DeepSpeed itself or under
``zero-offload run`` (tests/test_stand_in_hf.py). Writes {losses, deepspeed's file} to OUT and the fp32 weights
(``deepspeed.utils.safe_get_full_fp32_param``, a collective) to OUT.weights.pt on rank 0.

    python tests/stand_in_trainer.py OUT --stage 3 --offload [--resume STEP] [--pretrained DIR]

``--pretrained DIR`` loads the model with ``from_pretrained`` after the arguments exist, so at stage 3 transformers
builds it under ``deepspeed.zero.Init`` and loads its weights through ``GatheredParameters``.
"""
import argparse
import os
import sys

import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import build  # noqa: E402
from hf_trainer_runs import TokenData, training_args, zero_config  # noqa: E402
from stand_in_runs import write_out  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--resume", type=int, default=None)
    p.add_argument("--pretrained", default=None)
    a = p.parse_args()
    work = os.path.dirname(os.path.abspath(a.out))
    config = zero_config(a.stage, offload_optimizer=a.offload)
    if a.pretrained:      # DeepSpeed's zero.Init checks train_batch_size against a world size of its own: leave it out
        del config["train_batch_size"]
    args = training_args(os.path.join(work, "trainer"), deepspeed=config,
                         max_steps=4, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.pretrained) if a.pretrained else build("gpt2")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(24))
    resume = os.path.join(work, "trainer", f"checkpoint-{a.resume}") if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    write_out(a.out, losses, trainer.model_wrapped.module, trainer.is_world_process_zero())


if __name__ == "__main__":
    main()
