"""Supervised fine-tuning with TRL's SFTTrainer on zero-offload: ZeRO stage 3, optimizer and parameters offloaded
to the host, the config accelerate's templates use. The only change from a plain TRL script is the class line.

    python examples/trl_sft.py --out /tmp/sft --steps 20            # a tiny Llama written locally
    python examples/trl_sft.py --model Qwen/Qwen3-0.6B --out /tmp/sft  # any causal LM
"""
import datasets
import trl

from trl_common import DS_CONFIG, common_arguments, parse_args, sentences
from zero_offload.hf import ZeroOffloadTrainerMixin


class ZeroOffloadSFTTrainer(ZeroOffloadTrainerMixin, trl.SFTTrainer):
    """TRL's SFTTrainer with ``ds_config=``."""


def main() -> None:
    args = parse_args(__doc__, "sft-zero-offload", 30)
    data = datasets.Dataset.from_dict({"text": sentences(256, 12)})
    config = trl.SFTConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=3e-3,
                           **common_arguments(args))
    trainer = ZeroOffloadSFTTrainer(model=args.model, args=config, train_dataset=data, ds_config=DS_CONFIG)
    result = trainer.train()
    trainer.save_model(args.out)
    print(f"trained {result.global_step} steps, train loss {result.training_loss:.3f}; saved to {args.out}")


if __name__ == "__main__":
    main()
