#!/usr/bin/env bash
# The host Adam kernel against torch's fused AdamW and DeepSpeed's CPU Adam, and the memory bandwidth.
# Results on the reference machine: BENCHMARKS.md, "Host Adam kernel". Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu   # DeepSpeed's CPU Adam without an accelerator; compiles itself on first use
mkdir -p runs
# Same as `zero-offload bench optimizer ...` once the CLI is installed.
for dtype in bf16 fp16; do
    python3 -m zero_offload.bench.optimizer --params 50000000 --dtype "$dtype" --repeats 7 --json "runs/bench_optimizer_${dtype}.json" "$@"
done
