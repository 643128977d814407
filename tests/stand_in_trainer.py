"""transformers' Trainer with ``TrainingArguments(deepspeed=config)``, unchanged: run under DeepSpeed itself or
under ``zero-offload run`` (tests/test_stand_in_hf.py). Writes {losses, weights (fp32, from
deepspeed.utils.safe_get_full_fp32_param), deepspeed's file} to OUT on rank 0.

    python tests/stand_in_trainer.py OUT STAGE OFFLOAD(0|1) [RESUME_FROM_STEP]
"""
import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_runs import TokenData, training_args, zero_config  # noqa: E402
from hf_models import build  # noqa: E402


def main(out: str, stage: int, offload: bool, resume_step: int | None = None) -> None:
    work = os.path.dirname(os.path.abspath(out))
    cfg = zero_config(stage, offload_optimizer=offload)
    args = training_args(os.path.join(work, "trainer"), deepspeed=cfg, max_steps=4, save_strategy="steps",
                         save_steps=2, gradient_accumulation_steps=2)
    trainer = transformers.Trainer(model=build("gpt2"), args=args, train_dataset=TokenData(24))
    resume = os.path.join(work, "trainer", f"checkpoint-{resume_step}") if resume_step else None
    trainer.train(resume_from_checkpoint=resume)
    import deepspeed
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().float().cpu()
               for n, p in trainer.model_wrapped.module.named_parameters()}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(weights, out + ".weights.pt")
        with open(out, "w") as f:
            json.dump({"losses": losses, "deepspeed": deepspeed.__file__, "version": deepspeed.__version__}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]) if len(sys.argv) > 4 else None)
