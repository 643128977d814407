"""Stage-2 bucket buffers held after 3 steps (`engine.memory_breakdown()["buckets"]`), in buckets, for the bench
model (6 layers, hidden 512, vocab 4096, bf16, ZeRO-2 + CPU offload) at two bucket sizes, with and without
``overlap_comm``. Run it in two trees to compare: ``PYTHONPATH=$TREE/src python benchmarks/bench_bucket_pool.py``.
"""
import warnings

import torch

import zero_offload
from zero_offload.train.model import GPT, GPTConfig

warnings.simplefilter("ignore")     # an out-of-order growth warns; this counts what it holds
for bucket, overlap in ((2_000_000, True), (2_000_000, False), (262_144, True)):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=128, n_layer=6, n_head=8, n_embd=512))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": bucket,
                                 "overlap_comm": overlap}}
    engine = zero_offload.initialize(model, cfg)
    x = torch.randint(0, 4096, (2, 129))
    for _ in range(3):
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
    n = engine.memory_breakdown()["buckets"]["bytes"]
    print(f"bucket {bucket} overlap {overlap}: {n/2**20:.1f} MiB = {n / (bucket*2):.2f} buckets")
