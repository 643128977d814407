"""A GRPO step on zero-offload at stage 3 (optimizer and parameters offloaded) against stage 2 (optimizer
offloaded), on this machine's CPU, interleaved in each round (memory bandwidth drifts).

The bound: stage 3 costs no more than 1.5x stage 2, which holds only if generation gathers each unit once for the
whole ``generate`` (`Engine.gathered_for_generation`) rather than module by module at every token; the third
path shows the latter (``generate`` on the bare model: the module hooks gather at each token).

    python benchmarks/bench_trl_grpo.py --rounds 3 --steps 4
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import trl_runs as runs  # noqa: E402

warnings.filterwarnings("ignore")


def one(stage: int, model_dir: str, out: str, steps: int, by_module: bool = False) -> float:
    """Seconds per optimizer step of GRPO (its generation included), after one warm-up step; ``by_module``:
    generation gathers module by module."""
    from zero_offload.hf.facades import EngineModule
    gathered_once = EngineModule.generate
    if by_module:
        EngineModule.generate = lambda self, *a, **k: self.module.generate(*a, **k)
    kw = dict(max_steps=steps + 1, max_completion_length=16, num_generations=4, generation_batch_size=8,
              per_device_train_batch_size=4, gradient_checkpointing=True)
    trainer = runs.trainer_class("grpo", True)(
        model=model_dir, args=runs.trl_config("grpo", out, kw), train_dataset=runs.dataset("prompt", n=64),
        reward_funcs=runs.reward_even_words, ds_config=runs.zero_config(stage),
        processing_class=runs.tokenizer())
    times = []

    class Clock:       # a TrainerCallback without importing transformers' base: the Trainer calls these by name
        def __getattr__(self, name):
            return lambda *a, **k: None

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    try:
        trainer.train()
    finally:
        EngineModule.generate = gathered_once
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model_dir = runs.save_model_dir(os.path.join(d, "m"), hidden=256, layers=4)
        ratios, by_module = [], []
        for r in range(a.rounds):
            s2 = one(2, model_dir, os.path.join(d, f"s2-{r}"), a.steps)
            s3 = one(3, model_dir, os.path.join(d, f"s3-{r}"), a.steps)
            s3m = one(3, model_dir, os.path.join(d, f"s3m-{r}"), a.steps, by_module=True)
            ratios.append(s3 / s2)
            by_module.append(s3m / s2)
            print(f"round {r}: stage 2 + offload {s2:.3f} s/step; stage 3 + offload {s3:.3f} s/step "
                  f"(ratio {s3 / s2:.2f}); stage 3 generating module by module {s3m:.3f} s/step "
                  f"(ratio {s3m / s2:.2f})", flush=True)
        print(f"median ratio stage 3 / stage 2: {statistics.median(ratios):.2f} (bound 1.5); "
              f"module by module: {statistics.median(by_module):.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
