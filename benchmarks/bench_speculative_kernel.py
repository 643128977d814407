"""The host Adam kernel in place against out of place (super_offload's speculative step reads one bank of master
weights and moments and writes the other: `fused_adam_step(sources=...)`) and against an undo copy then in place
(``super_offload_fraction`` < 1: `zero_offload.hoststep.banks.UndoBank`), interleaved in each round as the
optimizer benchmark does, with fp32 and bf16 moments, on each instruction set this CPU has. Out of place costs a
read-for-ownership of the destination unless its stores stream (`fused_adam.STREAM_OUT_OF_PLACE`); the
`zero_offload.estimate.throughput.SPECULATIVE_KERNEL_COST` the planner uses comes from this table, and its
``UNDO_COPY_COST`` (`zero_offload.estimate.batching`) is checked by the last column.

    python benchmarks/bench_speculative_kernel.py [--elements 67108864] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from zero_offload.optim import _native
from zero_offload.optim import fused_adam as fa
from zero_offload.optim.fused_adam import fused_adam_step

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not fa.native_available():
        raise SystemExit("the native kernel is not built: pip install -e . (it builds it)")
    n = args.elements
    isas = [isa for isa in ("avx512", "avx2") if _native.set_isa(isa) == isa]
    print(f"{n:,} elements, {torch.get_num_threads()} threads, bf16 gradient; median of {args.rounds} rounds (ms)\n")
    print("| moments | ISA | in place | out of place | out of place, streaming stores | streaming / in place | "
          "undo copy + in place | undo / in place |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.randn(n).bfloat16()
        a = [torch.randn(n), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)]
        b = [t.clone() for t in a]                       # touched: no first-touch page faults in the timing
        undo = [t.clone() for t in a]

        def undo_then_in_place(step: int) -> None:
            for saved, live in zip(undo, a):
                saved.copy_(live)
            fused_adam_step(*a[:1], g, *a[1:], step=step, **HP)
        for isa in isas:
            _native.set_isa(isa)
            times = {"in": [], "out": [], "nt": [], "undo": []}
            for step in range(1, args.rounds + 2):
                times["in"].append(timed(lambda: fused_adam_step(*a[:1], g, *a[1:], step=step, **HP)))
                fa.STREAM_OUT_OF_PLACE = False
                try:
                    times["out"].append(timed(lambda: fused_adam_step(*b[:1], g, *b[1:], step=step, **HP,
                                                                      sources=tuple(a))))
                finally:
                    fa.STREAM_OUT_OF_PLACE = True
                times["nt"].append(timed(lambda: fused_adam_step(*a[:1], g, *a[1:], step=step, **HP,
                                                                 sources=tuple(b))))
                times["undo"].append(timed(lambda: undo_then_in_place(step)))
            med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}      # the first round warms up
            print(f"| {str(dtype).split('.')[-1]} | {isa} | {med['in']:.1f} | {med['out']:.1f} | {med['nt']:.1f} | "
                  f"{med['nt'] / med['in']:.2f}x | {med['undo']:.1f} | {med['undo'] / med['in']:.2f}x |", flush=True)
    _native.set_isa(None)


if __name__ == "__main__":
    main()
