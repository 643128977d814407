"""The registry of the CPU rows `python -m benchmarks.report` regenerates in BENCHMARKS.md's table of current figures.

Each row names the command of an existing benchmark (the one its BENCHMARKS.md section gives) and the extractor that
reads our figure, the peer's and the ratio from that command's result; rows that share a command share one run. The
table's other rows (GPU runs, predictions, and long or manual CPU runs such as the 2B NVMe demo) are not here: the
report keeps them as they are.
"""
from __future__ import annotations

from benchmarks import report_extract as ex
from benchmarks.report_types import Command, Row

DS_CPU = (("DS_ACCELERATOR", "cpu"),)
SMALL_GPT = ("--steps", "3", "--warmup", "1", "--repeats", "1", "--layers", "2", "--hidden", "128", "--heads", "2")

ADAM = Command(("python", "-m", "zero_offload.bench.optimizer", "--params", "50000000", "--dtype", "bf16",
                "--repeats", "7"), quick=("--params", "2000000", "--repeats", "3"), env=DS_CPU)
ZERO2 = Command(("python", "benchmarks/bench_engine.py", "--world-sizes", "1,2", "--steps", "15", "--warmup", "3",
                 "--repeats", "2"), quick=SMALL_GPT)
ZERO3 = Command(("python", "benchmarks/bench_engine.py", "--compare", "stage3", "--steps", "15", "--warmup", "3",
                 "--repeats", "2"), quick=SMALL_GPT)
TRAINER = Command(("python", "benchmarks/bench_trainer.py"),
                  quick=("--rounds", "1", "--steps", "4", "--warmup", "1", "--variants", "ours-stage2-offload"))
STAND_IN = Command(("python", "benchmarks/bench_stand_in.py", "--rounds", "5", "--steps", "30"),
                   quick=("--rounds", "1", "--steps", "8"))
CHECKPOINT = Command(("python", "benchmarks/bench_checkpoint.py", "--models", "tiny,gpt2", "--repeats", "3"),
                     quick=("--models", "tiny", "--repeats", "1"))
CONVERT = Command(("python", "benchmarks/bench_convert_memory.py", "--layers", "24", "--width", "1024"),
                  quick=("--layers", "2", "--width", "256", "--vocab", "4096"), json_flag=None)
NVME = Command(("python", "benchmarks/bench_nvme.py", "--dir", "/work/nvme_scratch", "--size-gb", "2", "--rounds", "4",
                "--dd-streams", "4", "--drop-caches", "--adam-numel", "500000000", "--sub-group", "50000000",
                "--threads", "2"), quick=("--size-gb", "0.2", "--adam-numel", "5000000", "--sub-group", "1000000",
                                          "--rounds", "2"), json_flag="--out", env=DS_CPU)
PLAN_CACHE = Command(("python", "benchmarks/bench_plan_cache.py", "--rounds", "2"), quick=("--rounds", "1"))
PLANNER = Command(("python", "benchmarks/bench_planner.py", "--host-mem", "8GiB", "--rounds", "1", "--steps", "3",
                   "--pair-steps", "8", "--pair-seconds", "30"),
                  quick=("--sizes", "xs", "--steps", "1", "--pair-steps", "2", "--pair-seconds", "2"))
TRL = Command(("python", "benchmarks/bench_trl_grpo.py", "--rounds", "5", "--steps", "4"),
              quick=("--rounds", "1", "--steps", "2"), json_flag=None)
MUON = Command(("python", "benchmarks/bench_muon.py"),
               quick=("--numel", "1048576", "--rounds", "2", "--ns-sizes", "64", "--n-layer", "2", "--n-embd", "128",
                      "--steps", "2"))
HOST_BYTES = Command(("python", "benchmarks/bench_bf16_masters.py", "--rss", "--variants", "masters",
                      "masters-grads-on-device", "--n-layer", "18", "--n-embd", "2048"),
                     quick=("--n-layer", "2", "--n-embd", "256", "--n-head", "4"))

TORCH_ADAM, DS_ADAM = "torch fused AdamW + 2 casts", "DeepSpeed CPUAdam + 2 casts"

ROWS: tuple[Row, ...] = (
    Row("adam-torch", "Host Adam step, 50M params, bf16 grad in and param out, fp32 master and moments", ADAM,
        ex.host_adam("zero-offload fused", TORCH_ADAM, "torch fused AdamW + 2 casts")),
    Row("adam-deepspeed", "Host Adam step, as above", ADAM,
        ex.host_adam("zero-offload fused", DS_ADAM, "DeepSpeed CPUAdam + 2 casts")),
    Row("adam-bf16-master", "Host Adam step, bf16 master and moments (14 B/param), nearest rounding", ADAM,
        ex.host_adam("zero-offload bf16 master, nearest", TORCH_ADAM, "torch fused AdamW + 2 casts")),
    Row("zero2-1rank", "ZeRO-2 + CPU offload step, bf16, 21M GPT, 1 rank", ZERO2,
        ex.engine_step("deepspeed", 1, "DeepSpeed")),
    Row("zero2-2ranks", "ZeRO-2 + CPU offload step, bf16, 21M GPT, 2 ranks", ZERO2,
        ex.engine_step("deepspeed", 2, "DeepSpeed")),
    Row("zero3-deepspeed", "ZeRO-3 step (no offload), bf16, 21M GPT, 2 ranks", ZERO3,
        ex.engine_step("deepspeed", 2, "DeepSpeed stage 3")),
    Row("zero3-fsdp2", "ZeRO-3 step (no offload), bf16, 21M GPT, 2 ranks", ZERO3,
        ex.engine_step("fsdp2", 2, "FSDP2")),
    Row("hf-trainer", "transformers Trainer step, ZeRO-2 + optimizer offload, 5.3M GPT-2, 1 rank", TRAINER,
        ex.trainer_step("ours-stage2-offload")),
    Row("stand-in-step", "A ZeRO-2 + offload step through `import deepspeed` (the stand-in), tiny GPT", STAND_IN,
        ex.stand_in("step_s")),
    Row("stand-in-startup", "Start-up to the first step through the stand-in", STAND_IN, ex.stand_in("startup_s")),
    Row("ckpt-save", "Checkpoint save, GPT-2 124M, ZeRO-2 + offload, bf16, 1 rank", CHECKPOINT,
        ex.checkpoint("save_s")),
    Row("ckpt-load", "Checkpoint load, as above", CHECKPOINT, ex.checkpoint("load_s")),
    Row("ckpt-consolidate", "`zero-offload consolidate` of that checkpoint to one fp32 file: peak memory",
        CHECKPOINT, ex.consolidate),
    Row("convert-memory", "Convert a DeepSpeed ZeRO-2 checkpoint (336M params) to DeepSpeed universal: peak memory",
        CONVERT, ex.convert("memory")),
    Row("convert-time", "Convert, as above: wall time", CONVERT, ex.convert("seconds")),
    Row("nvme-swapper", "NVMe swap I/O, write / read, 2.15 GB with O_DIRECT", NVME, ex.nvme_swapper),
    Row("nvme-host-step", "Host step with the states on NVMe, 500M-element bf16 partition (6 GB each way)", NVME,
        ex.nvme_host_step),
    Row("planner-warm", "Planner, `plan(\"gpt2\", 80 GB GPU)` in this process: recordings on disk vs none",
        PLAN_CACHE, ex.plan_cache("in process")),
    Row("planner-warm-subprocess", "Planner, as above, proxy in a subprocess (a GPU host, a rank of a job)",
        PLAN_CACHE, ex.plan_cache("subprocess")),
    Row("planner-choice", "Planned config vs every config that fits (4 GPT sizes, 8 GiB host cap)", PLANNER,
        ex.planner_verdict),
    Row("trl-grpo", "TRL GRPO step (generation included), stage 3 all offloaded vs stage 2 + optimizer offload", TRL,
        ex.trl_grpo),
    Row("muon-step", "Muon optimizer step, ZeRO-2 + offload on 2 ranks, 14.7M GPT", MUON, ex.muon_step),
    Row("muon-partition", "Muon's partition passes (momentum, update), 16.8M elements, bf16 grad", MUON,
        ex.muon_partition),
    Row("host-bytes", "Host bytes/param, bf16 masters and moments, gradient partition on the device (1B GPT)",
        HOST_BYTES, ex.host_bytes),
)

BY_NAME = {row.name: row for row in ROWS}
