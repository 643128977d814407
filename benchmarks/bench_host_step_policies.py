"""The host step's policies side by side, predicted (issue 28, item 4): plain offload, the delayed update,
``super_offload`` and the planner's ``ratio`` for GPT-2 XL and the 10B GPT-2 on one 80 GB GPU with a 128 GB
host, each at micro-batch 16 of 1024 tokens with activation checkpointing (the pinned 10B config of
`gpu_validate.py`), at stage 2 with the optimizer offloaded, accumulation 1, and the planner's own choice of
policy and accumulation (`zero_offload.estimate.batching.choose_batch`, as `zero_offload.estimate.plan` calls it).
Prints a markdown table: fits, predicted step s, device idle share, tokens/s, host GiB needed. No GPU needed: the step model replays the engine's recorded step with the plan's times
(`zero_offload.estimate.step_graph`); ``--calibration FILE`` uses a machine's measured rates (`zero-offload
calibrate`), else the built-in assumptions.

    python benchmarks/bench_host_step_policies.py [--calibration calibration.json]
"""
from __future__ import annotations

import argparse

from zero_offload.estimate.batching import Knobs, choose_batch
from zero_offload.estimate.memory import estimate_memory, model_shape
from zero_offload.estimate.planner import parse_bytes
from zero_offload.estimate.throughput import calibrated
from zero_offload.train.model import GPTConfig, preset

MODELS = {"GPT-2 XL (1.56B)": GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024),
          "GPT-2 10B": preset("gpt2-10b")}
# (delayed update, super_offload, ratio, super_offload_fraction); None: the planner chooses
POLICIES = {"plain offload": (False, False, 1.0, None), "delayed update": (True, False, 1.0, None),
            "super_offload, whole second bank": (False, True, 1.0, 1.0),
            "super_offload, the planner's share": (False, True, 1.0, None),
            "the planner's ratio": (False, False, None, None), "the planner's exact choice": (None, None, None, None)}
HEADROOM = 0.10      # the planner's


def policy_config() -> dict:
    """Stage 2, the optimizer offloaded with bf16 moments (the seed's config), micro-batch 16."""
    return {"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": True, "bf16_optimizer_states": True},
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True}}


def choose(cfg, policy: tuple, gpu_bytes: int, host_bytes: int, rates):
    """The planner's batch choice (`choose_batch`) for the config at this policy (None: the planner's)."""
    shape = model_shape(cfg)

    def measure(raw: dict, micro: int, ckpt):
        est = estimate_memory(shape, raw, 1, micro_batch=micro, activation_checkpointing=ckpt, accelerator=True)
        need = est.need()
        return est, {"device": max(0, int(need["device"] - gpu_bytes * (1 - HEADROOM))),
                     "host": max(0, int(need["host"] - host_bytes * (1 - HEADROOM))), "nvme": 0}
    free = policy[:3] == (None, None, None)  # the planner's choice: policy and accumulation; else accumulation 1
    knobs = Knobs(16, None if free else 1, True, policy[0], choose_checkpointing=False, super_offload=policy[1],
                  ratio=policy[2], super_offload_fraction=policy[3])
    return choose_batch(shape, policy_config(), 1, cfg.block_size, knobs, rates, measure)


def row(name: str, label: str, b) -> str:
    host = b.estimate.need()["host"] / 2**30
    if not b.fits or b.timing is None:
        short = ", ".join(f"{v / 2**30:.0f} GiB of {k}" for k, v in b.short.items() if v)
        return f"| {name} | {label} | no: {short} missing | - | - | - | {host:.0f} |"
    t = b.timing
    policy = "delayed" if b.delayed else ("super_offload" if b.speculative else "plain")
    policy += f" {b.fraction:g}" if b.speculative and b.fraction < 1 else ""
    policy += f", ratio {b.ratio:g}" if b.ratio < 1 else ""
    return (f"| {name} | {label} | yes ({policy}, accumulation {b.gas}) | {t.step_s:.2f} | "
            f"{t.graph.idle_share if t.graph else t.exposed_share:.2f} | {t.tokens_per_s:,.0f} | {host:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default=None, help="a zero-offload calibrate file (default: built-in)")
    parser.add_argument("--gpu-memory", default="80GB")
    parser.add_argument("--host-memory", default="128GB")
    args = parser.parse_args()
    rates = calibrated(args.calibration)
    gpu, host = parse_bytes(args.gpu_memory, "gpu_memory"), parse_bytes(args.host_memory, "host_memory")
    print(f"{args.gpu_memory} GPU, {args.host_memory} host; rates: {rates.source}\n")
    print("| model | policy | fits | step s | device idle | tokens/s | host GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, cfg in MODELS.items():
        for label, policy in POLICIES.items():
            print(row(name, label, choose(cfg, policy, gpu, host, rates)), flush=True)


if __name__ == "__main__":
    main()
