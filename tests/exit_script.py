"""A training script as a user writes it, for the process-exit tests (`test_clean_exit.py`, issue 26).

    python tests/exit_script.py CASE_JSON

``CASE_JSON`` names the ZeRO stage, the offload device, the delayed update, gradient accumulation, the
simulated streams and how the script ends (``return``: just return from main; ``close``: `engine.close()`;
``del``: drop the engine, then return). Run by itself it trains on one process; with ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` set (as ``torchrun`` sets them) it joins a gloo group and is one rank.
It prints one JSON line with the last loss on rank 0. With ``"sigint_after": k`` it saves a checkpoint after
every step and interrupts itself with SIGINT in the middle of step k (after its backward, before its optimizer
step), as Ctrl-C in a terminal does: it installs Python's KeyboardInterrupt handler first, since a process started
with SIGINT ignored (a background job of a non-interactive shell, ``nohup``) inherits SIG_IGN and Python then
installs none -- the interrupt would go nowhere and the script would finish normally.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_offload  # noqa: E402
from toy_model import batch, make_model  # noqa: E402


def config(case: dict, nvme_dir: str) -> dict:
    offload = case["offload"]
    zero = {"stage": case["stage"], "reduce_bucket_size": 500, "overlap_comm": True,
            "offload_optimizer": {"device": offload}}
    if offload == "nvme":
        zero["offload_optimizer"].update(nvme_path=nvme_dir, buffer_count=3)
        zero["sub_group_size"] = 3000
    # True: the delayed update; "super": super_offload; "ratio": ratio 0.5; "grads": the gradients on the device
    policy = case.get("dpu")
    if case["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=3000)
        if offload != "none" and policy != "ratio":
            params = "cpu" if policy == "super" else offload        # super_offload: parameters in memory
            zero["offload_param"] = {"device": params, **({"nvme_path": nvme_dir, "buffer_count": 3,
                                                           "buffer_size": 10_000} if params == "nvme" else {})}
    if policy is True:
        zero["offload_optimizer"].update(delayed_param_update=True, dpu_warmup_steps=1)
    elif policy in ("super", "ratio", "grads"):
        zero["offload_optimizer"].update({"super": {"super_offload": True}, "ratio": {"ratio": 0.5},
                                          "grads": {"gradients_on_device": True, "copy_chunk": 700}}[policy])
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": case["gas"],
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
            **({"aio": {"block_size": 8192}} if offload == "nvme" else {})}


def main(case: dict) -> None:
    torch.set_num_threads(1)       # the ranks share two cores
    rank, ws = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if ws > 1:
        dist.init_process_group("gloo")
    nvme_dir = case.get("nvme_dir") or tempfile.mkdtemp(prefix="zo-exit-")
    swap_dir = os.path.join(nvme_dir, f"rank{rank}")
    os.makedirs(swap_dir, exist_ok=True)
    if "sigint_after" in case and not case.get("keep_inherited_sigint"):
        signal.signal(signal.SIGINT, signal.default_int_handler)     # Ctrl-C's handler, whatever the parent left
    engine = zero_offload.initialize(make_model(), config(case, swap_dir))
    gas, loss = case["gas"], None
    for step in range(case["steps"]):
        x, y = batch(step, 2 * gas * ws)
        for k in range(gas):
            rows = slice((rank * gas + k) * 2, (rank * gas + k + 1) * 2)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            if step == case.get("sigint_after") and k == gas - 1:
                signal.raise_signal(signal.SIGINT)      # to this thread, handled before the call returns
            engine.step()
        if "sigint_after" in case:
            engine.save_checkpoint(case["checkpoint_dir"], tag=f"step{step + 1}")
    if rank == 0:
        print(json.dumps({"loss": loss.item()}), flush=True)
    if case["ending"] == "close":
        engine.close()
    elif case["ending"] == "del":
        del engine
    # "return": the engine, its threads and the process group are left for the interpreter's exit


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
