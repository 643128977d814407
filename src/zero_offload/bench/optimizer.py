"""`zero-offload bench optimizer`: the host Adam step, side by side with its peers, against memory bandwidth.

Each path does what ZeRO-Offload's host step needs on N parameters: a 16-bit gradient in, the fp32
master and both Adam moments updated, the 16-bit parameter out.

- zero-offload: `fused_adam_step`, one pass (28 bytes/param moved: 2 grad + 3 x (4 read + 4 write)
  + 2 out; 20 with bf16 moments). With ``--dtype bf16`` also bf16 master weights (DeepSpeed's
  ``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``: the master is the 16-bit parameter, 14
  bytes/param: 2 grad + 3 x (2 + 2)), rounded to nearest-even and stochastically.
- torch: the 16-bit gradient copied into an fp32 buffer, ``torch._fused_adamw_`` (what
  ``torch.optim.AdamW(fused=True)`` runs), the master copied into the 16-bit parameter (40 bytes/param:
  6 + 28 + 6).
- DeepSpeed: the same two copies around ``DeepSpeedCPUAdam.step`` (DeepSpeed's ZeRO stage-2 offload copies
  the gradient partition into an fp32 buffer, steps, then copies the fp32 partition into the 16-bit
  one; 40 bytes/param). Run with ``DS_ACCELERATOR=cpu``; its extension compiles on first use (~2 min).

Memory bandwidth: a STREAM triad ``a = b + s*c`` (12 bytes/element credited, STREAM's convention) and its
in-place form ``a += s*c`` (12 bytes, no write-allocate), on all cores; the higher of the two is the
limit each path's achieved bytes/s is divided by. Times are medians of ``--repeats`` runs after a warm-up,
the paths taking turns (round-robin) so that a noisy machine slows them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

from zero_offload.optim.fused_adam import active_isa, fused_adam_step

__all__ = ["main"]

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
OURS, OURS_BF16 = "zero-offload fused", "zero-offload fused, bf16 moments"
OURS_MASTER = {"nearest": "zero-offload bf16 master, nearest", "stochastic": "zero-offload bf16 master, stoch."}
TORCH, DEEPSPEED = "torch fused AdamW + 2 casts", "DeepSpeed CPUAdam + 2 casts"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _triad(n: int) -> Callable[[], None]:
    """STREAM triad ``a = b + s*c`` (torch, all cores): 12 bytes per element credited."""
    a, b, c = torch.ones(n), torch.rand(n), torch.rand(n)
    return lambda: torch.add(b, c, alpha=3.0, out=a)


def _triad_inplace(n: int) -> Callable[[], None]:
    """In-place triad ``a += s*c``: 12 bytes per element, with no write-allocate traffic."""
    a, c = torch.ones(n), torch.rand(n)
    return lambda: a.add_(c, alpha=1e-3)


def _ours(n: int, dtype: torch.dtype, state_dtype: torch.dtype) -> Callable[[], None]:
    master, grad = torch.randn(n), torch.randn(n).to(dtype)
    m, v, out = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype), torch.empty(n, dtype=dtype)
    step = [0]

    def run():
        step[0] += 1
        fused_adam_step(master, grad, m, v, step=step[0], out=out, **HP)

    return run


def _ours_bf16_master(n: int, rounding: str) -> Callable[[], None]:
    master, grad = torch.randn(n).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    step = [0]

    def run():
        step[0] += 1
        fused_adam_step(master, grad, m, v, step=step[0], rounding=rounding, seed=step[0], **HP)

    return run


def _torch(n: int, dtype: torch.dtype) -> Callable[[], None]:
    master, grad = torch.randn(n), torch.randn(n).to(dtype)
    m, v, out, g32 = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=dtype), torch.empty(n)
    step = torch.zeros(())

    def run():
        g32.copy_(grad)
        step.add_(1)
        torch._fused_adamw_([master], [g32], [m], [v], [], [step], lr=HP["lr"], beta1=HP["beta1"],
                            beta2=HP["beta2"], weight_decay=HP["weight_decay"], eps=HP["eps"],
                            amsgrad=False, maximize=False)
        out.copy_(master)

    return run


def _deepspeed(n: int, dtype: torch.dtype) -> Callable[[], None]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415  (optional peer, compiles on first use)

    master = torch.nn.Parameter(torch.randn(n))
    grad, out = torch.randn(n).to(dtype), torch.empty(n, dtype=dtype)
    master.grad = torch.empty(n)
    opt = DeepSpeedCPUAdam([master], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                           weight_decay=HP["weight_decay"], adamw_mode=True)

    def run():
        master.grad.copy_(grad)
        opt.step()
        out.copy_(master.data)

    return run


def _row(name, seconds, n, bytes_per_param, limit_gbs, error=None):
    if seconds is None:
        return {"path": name, "error": error, "bytes_per_param": bytes_per_param}
    gbs = bytes_per_param * n / seconds / 1e9
    return {"path": name, "seconds": seconds, "gparams_per_s": n / seconds / 1e9, "bytes_per_param": bytes_per_param,
            "achieved_gb_s": gbs, "fraction_of_bandwidth": gbs / limit_gbs}


def _format(result: dict) -> str:
    lines = [f"host Adam step: {result['params']:,} params, {result['dtype']} grad/param, "
             f"{result['threads']} threads, kernel ISA {result['isa']}, median of {result['repeats']}",
             f"memory bandwidth: triad a=b+s*c {result['bandwidth']['triad']:.1f} GB/s, "
             f"in place a+=s*c {result['bandwidth']['triad_inplace']:.1f} GB/s "
             f"-> limit {result['limit_gb_s']:.1f} GB/s",
             "",
             f"{'path':<34}{'Gparam/s':>9}{'B/param':>9}{'GB/s':>8}{'of BW':>8}{'vs torch':>10}{'vs DS':>8}"]
    ref = {r["path"]: r.get("gparams_per_s") for r in result["rows"]}
    t_ref, ds_ref = ref.get(TORCH), ref.get(DEEPSPEED)
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['path']:<34}  unavailable: {r['error']}")
            continue
        vs_t = f"{r['gparams_per_s'] / t_ref:.2f}x" if t_ref else "-"
        vs_ds = f"{r['gparams_per_s'] / ds_ref:.2f}x" if ds_ref else "-"
        lines.append(f"{r['path']:<34}{r['gparams_per_s']:>9.3f}{r['bytes_per_param']:>9}{r['achieved_gb_s']:>8.1f}"
                     f"{100 * r['fraction_of_bandwidth']:>7.0f}%{vs_t:>10}{vs_ds:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table (and write ``--json PATH``). Returns the exit status (0)."""
    ap = argparse.ArgumentParser(prog="zero-offload bench optimizer", description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=50_000_000, help="parameters per step (default 50M)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="16-bit gradient/parameter dtype")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per path; the median is reported")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when importable")
    args = ap.parse_args(argv)
    if args.params < 1 or args.repeats < 1:
        ap.error("--params and --repeats must be >= 1")
    n, dtype = args.params, DTYPES[args.dtype]
    n_bw = max(n, 1 << 25)  # 128 MiB per array at least: far beyond any last-level cache
    # (name, elements, bytes per element, setup); every path is set up, then all are timed round-robin
    # so that a change in the machine's load or memory speed hits every path alike.
    specs = [("triad", n_bw, 12, lambda: _triad(n_bw)), ("triad_inplace", n_bw, 12, lambda: _triad_inplace(n_bw)),
             (OURS, n, 28, lambda: _ours(n, dtype, torch.float32)),
             (OURS_BF16, n, 20, lambda: _ours(n, dtype, torch.bfloat16)),
             (TORCH, n, 40, lambda: _torch(n, dtype))]
    if dtype == torch.bfloat16:
        specs += [(OURS_MASTER[r], n, 14, lambda r=r: _ours_bf16_master(n, r)) for r in OURS_MASTER]
    if not args.no_deepspeed:
        specs.append((DEEPSPEED, n, 40, lambda: _deepspeed(n, dtype)))
    runs, errors = {}, {}
    for name, _, _, setup in specs:
        try:
            fn = setup()
            fn()
            fn()  # warm-up: first-touch page faults, DeepSpeed's state allocation
            runs[name] = fn
        except Exception as exc:  # DeepSpeed missing, or its extension failed to build
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(_timed(fn))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    bw = {name: 12 * n_bw / med[name] / 1e9 for name in ("triad", "triad_inplace")}
    limit = max(bw.values())
    rows = [_row(name, med.get(name), count, bpp, limit, errors.get(name))
            for name, count, bpp, _ in specs if not name.startswith("triad")]
    isa = active_isa()
    result = {"params": n, "dtype": args.dtype, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "isa": isa, "torch": torch.__version__, "bandwidth": bw, "limit_gb_s": limit, "rows": rows}
    print(_format(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
