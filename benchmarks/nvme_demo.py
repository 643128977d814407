"""The ZeRO-Infinity demo: a GPT whose fp32 optimizer states exceed this machine's RAM, trained on the CPU
with ZeRO stage 3, the optimizer states on NVMe (swap files), the parameters in host memory, bf16 (fp32 on
a CPU without a fast bf16 GEMM, see ``--precision``) and activation checkpointing.

Default: a 2.02B-parameter GPT (24 layers, n_embd 2560, GPT-2 vocabulary), 24.2 GB of fp32 optimizer states.
In bf16 all of them (masters and both Adam moments) are on disk and the host holds ~4 GB of bf16 parameters
and ~4 GB of bf16 gradient partition. In fp32 the parameters are their own masters: 8 GB of fp32 parameters
and 8 GB of gradient partition in host memory, the two moments (16 GB) on disk.

    python benchmarks/nvme_demo.py --nvme-path /work/nvme_scratch --steps 4          # the full demo
    python benchmarks/nvme_demo.py --nvme-path /work/nvme_scratch --n-layer 2 --n-embd 128 --steps 4  # a check
    DS_ACCELERATOR=cpu python benchmarks/nvme_demo.py --deepspeed ...                  # DeepSpeed, same config

The model is built on the meta device (`zero_offload.init_sharded`) and materialised module by module, so
no full copy of it ever exists in RAM. It trains on one fixed batch of real text (bytes of this Python's
standard library), so the loss falls within a few steps. Prints one JSON line per step (loss, step time
split into forward+backward compute, waiting on reads, host Adam, waiting on writes; peak RSS; bytes on
disk) and a summary; files are removed at exit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

import zero_offload
from zero_offload.train.model import GPT, GPTConfig, count_parameters


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakSampler:
    """Peak anonymous RSS, sampled every 10 ms from /proc/self/status (VmHWM counts libraries too)."""

    def __init__(self):
        self.peak = status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, status_kib("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak * 1024


def text_batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of byte tokens from the standard library's source (real text, no download)."""
    import inspect
    import textwrap
    data = (inspect.getsource(textwrap) + inspect.getsource(argparse)).encode()[: batch * (seq + 1)]
    t = torch.tensor(list(data), dtype=torch.long).view(batch, seq + 1)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def gpt2_init(module: torch.nn.Module) -> None:
    """GPT-2's initialisation, one module at a time (what `GPT.init_weights` does for the whole model)."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    elif isinstance(module, torch.nn.Embedding):
        torch.nn.init.normal_(module.weight, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def ds_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": args.precision == "bf16"}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": args.sub_group_size, "overlap_comm": True,
            "offload_param": ({"device": "cpu"} if args.offload_param == "cpu" else
                              {"device": "nvme", "nvme_path": str(args.nvme_path), "buffer_count": 4,
                               "buffer_size": args.param_buffer_size}),
            "offload_optimizer": {"device": "nvme", "nvme_path": str(args.nvme_path), "buffer_count": 4,
                                  "pipeline_read": args.pipeline, "pipeline_write": args.pipeline},
            "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": args.io_threads,
                "single_submit": False, "overlap_events": True},
    }


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def param_store_stats(engine) -> dict:
    """With offload_param nvme: how the gathers found their shards, and the most elements held at once."""
    store = engine.zero.store
    if store.resident:
        return {}
    return {"param_shards_read_ahead": store.shards_read_ahead, "param_shards_on_demand": store.shards_read_on_demand,
            "param_peak_resident_numel": store.peak_resident_numel}


def run_zero_offload(args, gpt: GPTConfig) -> dict:
    with zero_offload.init_sharded():
        model = GPT(gpt)
    sampler = PeakSampler()
    t0 = time.perf_counter()
    engine = zero_offload.initialize(model, ds_config(args), param_init_fn=gpt2_init)
    init_s = time.perf_counter() - t0
    x, y = text_batch(args.batch, args.seq_len)
    adam = engine.zero.adam
    losses = []
    for step in range(args.steps):
        adam.timings = dict.fromkeys(adam.timings, 0.0)
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        step_s = time.perf_counter() - t0
        losses.append(loss.item())
        rec = {"step": step + 1, "loss": losses[-1], "step_s": step_s,
               "compute_s": engine.timings["forward_s"] + engine.timings["backward_s"],
               "optimizer_s": engine.timings["optimizer_s"], **adam.timings,
               "peak_rss_anon_bytes": sampler.peak * 1024, **param_store_stats(engine),
               "bytes_on_disk": disk_bytes(Path(args.nvme_path) / "zero_offload")}
        print(json.dumps(rec), flush=True)
    return {"init_s": init_s, "losses": losses, "loss_fell": losses[-1] < losses[0],
            "peak_rss_anon_bytes": sampler.stop(), "peak_rss_total_bytes": status_kib("VmHWM") * 1024,
            "bytes_on_disk": disk_bytes(Path(args.nvme_path) / "zero_offload"),
            "swap_bytes_announced": adam.bytes_on_disk}


def run_deepspeed(args, gpt: GPTConfig) -> dict:
    """DeepSpeed 0.19 with the same config on this CPU machine; reports what happens."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29533"}.items():
        os.environ.setdefault(k, v)
    try:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        config = ds_config(args)
        sampler = PeakSampler()
        t0 = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(gpt)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        init_s = time.perf_counter() - t0
        x, y = text_batch(args.batch, args.seq_len)
        losses = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            print(json.dumps({"step": step + 1, "loss": losses[-1], "step_s": time.perf_counter() - t0,
                              "peak_rss_anon_bytes": sampler.peak * 1024}), flush=True)
        return {"deepspeed": "ran", "init_s": init_s, "losses": losses, "loss_fell": losses[-1] < losses[0],
                "peak_rss_anon_bytes": sampler.stop(), "peak_rss_total_bytes": status_kib("VmHWM") * 1024}
    except BaseException as e:   # report what happened: DeepSpeed is the peer, not the product
        import traceback
        return {"deepspeed": "failed", "error": f"{type(e).__name__}: {str(e)[:2000]}",
                "where": traceback.format_exc()[-1500:]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme-path", default="/work/nvme_scratch", help="directory for the swap files")
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=2560)
    ap.add_argument("--n-head", type=int, default=20)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--sub-group-size", type=int, default=50_000_000, help="elements per NVMe sub-group")
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="auto: bf16 where torch has a fast bf16 CPU GEMM (oneDNN on AVX512-BF16/AMX), else fp32")
    ap.add_argument("--offload-param", choices=("cpu", "nvme"), default="cpu",
                    help="where the 16-bit parameter partitions live (nvme: swap files + a 4-buffer pool)")
    ap.add_argument("--param-buffer-size", type=int, default=130_000_000,
                    help="offload_param.buffer_size: elements per buffer, at least the largest unit (wte)")
    ap.add_argument("--deepspeed", action="store_true", help="run DeepSpeed with the same config instead")
    ap.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                    help="pipeline_read / pipeline_write off (DeepSpeed 0.19.8's pipelined swapper asserts at "
                         "swap-out in some configs)")
    args = ap.parse_args(argv)
    if args.precision == "auto":
        # Without oneDNN's bf16 path torch multiplies bf16 matrices with a scalar loop, ~100x slower than
        # fp32 on an AVX2 host: a 2B-parameter step would take hours (BENCHMARKS.md, "NVMe").
        args.precision = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    gpt = GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, activation_checkpointing=True)
    n = count_parameters(gpt).total
    head = {"params": n, "fp32_optimizer_state_bytes": 12 * n, "machine_ram_bytes":
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "torch_threads": torch.get_num_threads(),
            "precision": args.precision}
    print(json.dumps(head), flush=True)
    result = {**head, **(run_deepspeed(args, gpt) if args.deepspeed else run_zero_offload(args, gpt))}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
