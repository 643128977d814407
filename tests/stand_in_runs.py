"""Run one unchanged DeepSpeed script twice, under DeepSpeed 0.19.8 itself (CPU accelerator) and under
``zero-offload run``, and compare what each wrote (tests/test_stand_in_hf.py, tests/test_stand_in_scripts.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
TOL = 1e-5


def launch(script: str, under_stand_in: bool, work: Path, world: int, *script_args, launcher=None) -> dict:
    """Run ``tests/<script> OUT ARGS`` on ``world`` ranks (``python`` with the launcher's variables for one rank,
    torch's elastic launcher for more, or ``launcher(port)``'s command, e.g. ``accelerate launch ...``); returns
    the JSON it wrote to OUT with ``weights`` from OUT.weights.pt. Asserts it exited 0 and ran on the DeepSpeed
    it was meant to."""
    from dist_utils import _free_port
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]))
    if launcher is not None:
        cmd = launcher(port)
    elif world == 1:    # a DeepSpeed script run as `python train.py` needs the launcher's variables under DeepSpeed
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}"]
    cmd += [str(TESTS / script), str(work / "out.json"), *script_args]
    if under_stand_in:
        cmd = [sys.executable, "-m", "zero_offload", "run", "--", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((work / "out.json").read_text())
    out["weights"] = torch.load(work / "out.json.weights.pt")
    assert ("zero_offload" in out["deepspeed"]) == under_stand_in, out["deepspeed"]
    return out


def assert_agree(ours: dict, theirs: dict, steps: int = 4) -> None:
    """Losses and every fp32 weight within `TOL`; the other recorded values equal."""
    assert len(ours["losses"]) == len(theirs["losses"]) == steps
    gap = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
    assert gap < TOL, (ours["losses"], theirs["losses"])
    assert set(ours["weights"]) == set(theirs["weights"])
    diff = max((ours["weights"][k] - theirs["weights"][k]).abs().max().item() for k in ours["weights"])
    assert diff < TOL, diff
    for key in set(ours) - {"losses", "weights", "deepspeed", "ref_logits"}:
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    if "ref_logits" in ours:
        assert max(abs(a - b) for a, b in zip(ours["ref_logits"], theirs["ref_logits"])) < 1e-4


def write_out(out: str, losses: list, module, rank_zero: bool, **extra) -> None:
    """What a script run by `launch` leaves: on every rank, each parameter's fp32 weight gathered with
    ``deepspeed.utils.safe_get_full_fp32_param`` (a collective); on rank 0 {losses, deepspeed's file, extra} in
    ``out`` and the weights in ``out``.weights.pt."""
    import deepspeed
    weights = {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().float().cpu()
               for n, p in module.named_parameters()}
    if rank_zero:
        torch.save(weights, out + ".weights.pt")
        Path(out).write_text(json.dumps({"losses": losses, "deepspeed": deepspeed.__file__, **extra}))
    end_process_group()


def end_process_group() -> None:
    """Destroy the process group before the script returns, as a well-kept script does: gloo's workers let go of
    the last collectives' tensors before the interpreter exits (else either DeepSpeed's run or ours can abort at
    exit with "terminate called without an active exception": `zero_offload.comm.handover`)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
