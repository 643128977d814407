"""Median optimizer-step time of ZeRO-2 + CPU offload under gradient accumulation, one rank: the path where later
micro-steps' gradients come down through the pinned staging and are added on the host. Bench model of
bench_engine.py (6 layers, hidden 512, vocab 4096, sequence 128, bf16). Run it in two trees, alternating, to
compare: ``PYTHONPATH=$TREE/src python benchmarks/bench_accumulation.py --gas 2``.
"""
import argparse
import statistics
import time

import torch

import zero_offload
from zero_offload.train.model import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--bucket", type=float, default=5e6, help="reduce_bucket_size (elements)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=128, n_layer=6, n_head=8, n_embd=512))
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
           "gradient_clipping": args.clip, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                                 "reduce_bucket_size": int(args.bucket)}}
    engine = zero_offload.initialize(model, cfg)
    data = torch.randint(0, 4096, (args.micro_batch, 129), generator=torch.Generator().manual_seed(1))
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        for _ in range(args.gas):
            _, loss = engine(data[:, :-1], data[:, 1:])
            engine.backward(loss)
            engine.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    print(f"gas {args.gas}: median step {1000 * statistics.median(times):.1f} ms, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
