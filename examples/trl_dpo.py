"""Preference tuning with TRL's DPOTrainer on zero-offload: ZeRO stage 3 with everything offloaded; the reference
model TRL builds is sharded the same way (an `InferenceEngine`: no gradients, no optimizer state).

    python examples/trl_dpo.py --out /tmp/dpo --steps 10
"""
import datasets
import trl

from trl_common import DS_CONFIG, common_arguments, parse_args, sentences
from zero_offload.hf import ZeroOffloadTrainerMixin


class ZeroOffloadDPOTrainer(ZeroOffloadTrainerMixin, trl.DPOTrainer):
    """TRL's DPOTrainer with ``ds_config=``."""


def main() -> None:
    args = parse_args(__doc__, "dpo-zero-offload", 10)
    good, bad = sentences(64, 8, seed=1), sentences(64, 8, seed=2)
    data = datasets.Dataset.from_dict({"prompt": [s[:11] for s in good], "chosen": [s[11:] for s in good],
                                       "rejected": [" ".join(reversed(s.split()))[:20] for s in bad]})
    config = trl.DPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                           beta=0.1, **common_arguments(args))
    trainer = ZeroOffloadDPOTrainer(model=args.model, args=config, train_dataset=data, ds_config=DS_CONFIG)
    result = trainer.train()
    held = trainer.frozen_engines[0].memory_breakdown()["frozen_params"] if trainer.frozen_engines else None
    print(f"trained {result.global_step} steps, train loss {result.training_loss:.3f}; "
          f"reference model shard on this rank: {held}")


if __name__ == "__main__":
    main()
