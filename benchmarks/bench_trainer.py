"""transformers' Trainer step time: plain (torch AdamW) against zero_offload.hf.Trainer, as a ratio, 1 rank, CPU.

The same GPT-2 (built from a config, same seed), the same random-token data and the same TrainingArguments
(fp32, batch 8 x 128 tokens, no accumulation, max_grad_norm 1.0, torch AdamW / our host Adam through the
Trainer's own param groups). Rounds are interleaved: each round runs every variant once, in a fresh Trainer,
and a variant's step time in a round is the median of its timed steps (the first ``--warmup`` steps dropped).
A step is the wall time from the Trainer's ``on_step_begin`` to ``on_step_end`` callback: data, forward,
backward, clipping, the optimizer step and the schedule. The table gives each variant's median step time over
rounds and its ratio to plain, paired within each round (median of the per-round ratios).

    python benchmarks/bench_trainer.py                      # 3 rounds of 12 steps, all variants
    python benchmarks/bench_trainer.py --rounds 5 --variants plain ours-stage2-offload --json /tmp/t.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings

import torch

VARIANTS = ("plain", "ours-stage0", "ours-stage2-offload", "ours-stage3-offload")


def zero_config(variant: str) -> dict | None:
    """None for the plain Trainer; else the ds_config of the variant (everything the arguments know "auto")."""
    if variant == "plain":
        return None
    stage = int(variant.split("stage")[1][0])
    zc: dict = {"stage": stage}
    if variant.endswith("offload"):
        zc["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zc["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": zc}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_once(variant: str, args) -> list[float]:
    """Train ``args.steps`` steps of ``variant`` in a fresh Trainer; returns the timed steps' seconds."""
    import transformers

    from zero_offload.hf import Trainer

    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers,
                                  n_head=args.dim // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=3e-4,
            weight_decay=0.01, max_grad_norm=1.0, optim="adamw_torch", save_strategy="no", report_to=[],
            logging_steps=10 ** 6, use_cpu=True, disable_tqdm=True, seed=0)
        data = Tokens(args.steps * args.batch, args.seq, args.vocab)
        ds_config = zero_config(variant)
        if ds_config is None:
            trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[Timer()])
        else:
            trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Timer()], ds_config=ds_config)
        trainer.train()
    return times[args.warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    variants = ["plain"] + [v for v in args.variants if v != "plain"]
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]     # alternate the order: no variant always first
        for v in order:
            per_round[v].append(statistics.median(run_once(v, args)))
    params = sum(p.numel() for p in __import__("transformers").GPT2LMHeadModel(
        __import__("transformers").GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.dim,
                                              n_layer=args.layers, n_head=args.dim // 64)).parameters())
    print(f"GPT-2 {params / 1e6:.1f}M params, batch {args.batch} x {args.seq}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps; {platform.machine()}")
    print(f"{'variant':<22}{'median step (s)':>16}{'ratio to plain':>16}")
    result = {"args": vars(args), "params": params, "variants": {}}
    for v in variants:
        ratios = [a / b for a, b in zip(per_round[v], per_round["plain"])]
        med, ratio = statistics.median(per_round[v]), statistics.median(ratios)
        print(f"{v:<22}{med:>16.4f}{ratio:>16.3f}")
        result["variants"][v] = {"step_s_per_round": per_round[v], "ratio_per_round": ratios, "ratio": ratio}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
