"""The exact plan for each model and host size, and what a stale step would add: docs/offload.md's table.

For each model on one GPU (``--models``: ``name:device memory``; default GPT-2 124M on 8 GB, GPT-2 XL on 24 GB and
the seed's 10B on an H200's 139 GB, each where offload decides what fits) with each of ``--host-mem``'s host sizes
(and ``--nvme`` of NVMe, if given), `zero_offload.plan` is asked twice: exact (its default) and with
``allow_stale_step=True``. One markdown row per pair: the exact plan's row, micro-batch x accumulation, host-step
policy (``super_offload`` and its fraction, ``ratio``), predicted step, tokens/s and exposed share, then the stale
plan's tokens/s against the exact one's; MFU is 6 x parameters x tokens/s over the matmul peak (the sustained
rate / `TRAINING_SHARE_OF_MATMUL`, as ``estimate --largest`` reports it).
These are the step model's predictions on its figures (built-in, or ``--calibration FILE``), not measurements.

    PYTHONPATH=src python benchmarks/exact_plans.py --host-mem 64GB,128GB,256GB --nvme 1TB
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

MODELS = "gpt2:8GB,gpt2-xl:24GB,gpt2-10b:139GB"


def _policy(config: dict) -> str:
    oo = config.get("zero_optimization", {}).get("offload_optimizer", {})
    parts = []
    if oo.get("super_offload"):
        parts.append(f"super_offload {oo.get('super_offload_fraction', 1.0):g}")
    if oo.get("ratio", 1.0) < 1.0:
        parts.append(f"ratio {oo['ratio']:g}")
    if oo.get("delayed_param_update"):
        parts.append("delayed update")
    return ", ".join(parts) or ("plain" if oo else "-")


def row(model: str, gpu_mem: str, host_mem: str, nvme, calibration, moments: bool = False) -> str:
    """One markdown row: the exact plan and the stale one's gain (see the module docstring)."""
    from zero_offload.estimate import model_shape, plan
    from zero_offload.estimate.throughput import TRAINING_SHARE_OF_MATMUL, calibrated
    exact = plan(model, 1, gpu_mem, host_mem, nvme, calibration=calibration, allow_bf16_moments=moments)
    where = f"{model} | {gpu_mem} | {host_mem}" + (f" + {nvme} NVMe" if nvme else "")
    if not exact.fits:
        return f"| {where} | does not fit | | | | | | |"
    stale = plan(model, 1, gpu_mem, host_mem, nvme, calibration=calibration, allow_stale_step=True,
                 allow_bf16_moments=moments)
    t, s = exact.batch.timing, stale.batch.timing
    batch = f"{exact.batch.micro} x {exact.batch.gas}"
    peak = calibrated(calibration).gpu_flops / TRAINING_SHARE_OF_MATMUL        # the matmul peak, as `largest`
    mfu = 6 * model_shape(model).n_params * t.tokens_per_s / peak
    gain = f"{s.tokens_per_s / t.tokens_per_s:.2f}x ({_policy(stale.config)})" if stale.fits else "-"
    return (f"| {where} | {exact.name} | {batch} | {_policy(exact.config)} | {t.step_s:.2f} | "
            f"{t.tokens_per_s:,.0f} ({t.exposed_share:.0%}) | {mfu:.2f} | {gain} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-mem", default="64GB,128GB,256GB", help="comma-separated host sizes")
    parser.add_argument("--models", default=MODELS, help="comma-separated name:device-memory pairs")
    parser.add_argument("--nvme", default=None, help="NVMe bytes for the swap files (default: none)")
    parser.add_argument("--calibration", default=None, help="a `zero-offload calibrate` file (default: built-in)")
    parser.add_argument("--allow-bf16-moments", action="store_true", help="let the plans keep bf16 Adam moments")
    args = parser.parse_args(argv)
    print(f"one GPU, NVMe {args.nvme or 'none'}; predicted by the step model, not measured")
    print("| model | device | host | exact plan | micro x accumulation | host step | step s | tokens/s (exposed) | "
          "MFU | stale step allowed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for pair in args.models.split(","):
        model, gpu_mem = pair.split(":")
        for host in args.host_mem.split(","):
            print(row(model, gpu_mem, host, args.nvme, args.calibration, args.allow_bf16_moments), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
