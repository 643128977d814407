"""Reinforcement learning with TRL's GRPOTrainer on zero-offload: ZeRO stage 3 with everything offloaded. Each
step generates several completions per prompt; the engine gathers the model once for the whole ``generate``
where it fits on the device (TRL's ``ds3_gather_for_generation`` under DeepSpeed), and the reference model
(``beta`` > 0) is sharded like the policy.

    python examples/trl_grpo.py --out /tmp/grpo --steps 10
"""
import datasets
import trl

from trl_common import DS_CONFIG, common_arguments, parse_args, sentences
from zero_offload.hf import ZeroOffloadTrainerMixin


class ZeroOffloadGRPOTrainer(ZeroOffloadTrainerMixin, trl.GRPOTrainer):
    """TRL's GRPOTrainer with ``ds_config=``."""


def continues_the_count(completions, prompts, **kwargs) -> list[float]:
    """Reward: the share of completion words that continue the prompt's count (w7 w8 -> w9 w10 ...)."""
    out = []
    for prompt, completion in zip(prompts, completions):
        last = int(prompt.split()[-1][1:])
        words = completion.split()
        out.append(sum(w == f"w{(last + 1 + k) % 200}" for k, w in enumerate(words)) / max(1, len(words)))
    return out


def main() -> None:
    args = parse_args(__doc__, "grpo-zero-offload", 10)
    data = datasets.Dataset.from_dict({"prompt": sentences(64, 4)})
    config = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                            gradient_accumulation_steps=1, learning_rate=1e-3, beta=0.04, **common_arguments(args))
    trainer = ZeroOffloadGRPOTrainer(model=args.model, args=config, train_dataset=data,
                                     reward_funcs=continues_the_count, ds_config=DS_CONFIG)
    result = trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(f"trained {result.global_step} steps; mean reward per logged step: "
          + ", ".join(f"{r:.3f}" for r in rewards))


if __name__ == "__main__":
    main()
