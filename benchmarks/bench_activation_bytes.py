"""The memory model's activations of a 1B decoder at a long sequence against what autograd saves.

Llama-3.2-1B's shape (``shapes/llama-3.2-1b.json``: hidden 2048, MLP 8192, 32 query and 8 key/value heads of 64,
vocabulary 128256; 1,235,814,400 parameters as 16 blocks) at ``--seq-len`` tokens (32K by default), one sequence,
fp32 on the CPU, activation checkpointing on and the logits and loss in ``--loss-tiles`` tiles
(`TiledFusedLogitsLoss`: untiled, the fp32 log-probabilities alone would be 16.8 GB at 32K). ``--layers`` of its 16
blocks run, to keep the CPU's time to minutes: with checkpointing every block saves the same thing, its input
(d*T*h), so 16 blocks save 14 more block inputs than 2, and nothing else changes.

Measured: one forward, then the last block run again as checkpoint's recompute runs it in backward, each storage
autograd saves counted once, parameters excluded (``measured_saved_bytes`` of tests/test_decoder_activations.py, the
measurement its exact small-shape tests use). Beside it the memory model's `decoder_saved_bytes` for the same model
(``loss_tiled``), plus the caller's own loss code (the labels padded a column to shift them, an int64 token count,
no cross entropy's 4-byte total weight). Prints JSON: both counts, their ratio, the seconds taken.

    python benchmarks/bench_activation_bytes.py --json runs/bench_activation_bytes.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = ROOT / "benchmarks" / "shapes" / "llama-3.2-1b.json"


def build(layers: int):
    """The shape's decoder with ``layers`` blocks, fp32, SDPA attention, checkpointing on, in training mode."""
    import transformers
    fields = json.loads(SHAPE.read_text())
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype", "model_type")}
    cfg = transformers.LlamaConfig(**{**fields, "num_hidden_layers": layers}, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().train()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=2, help="blocks of the shape's 16 that run")
    ap.add_argument("--loss-tiles", type=int, default=16)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    from test_decoder_activations import measured_saved_bytes, tiled_loss_caller_bytes
    from zero_offload.estimate.decoder_activations import decoder_saved_bytes, decoder_shape
    model = build(args.layers)
    start = time.perf_counter()
    measured = measured_saved_bytes(model, 1, args.seq_len, True, loss_tiles=args.loss_tiles)
    seconds = time.perf_counter() - start
    predicted = (decoder_saved_bytes(decoder_shape(model.config, True), 1, args.seq_len, 4, loss_tiled=True)
                 + tiled_loss_caller_bytes(1))
    result = {"shape": SHAPE.name, "layers": args.layers, "seq_len": args.seq_len, "loss_tiles": args.loss_tiles,
              "dtype": "float32", "measured_bytes": measured, "predicted_bytes": predicted,
              "predicted_over_measured": predicted / measured, "seconds": round(seconds, 1),
              "torch": torch.__version__}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
