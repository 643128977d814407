"""The step model's recordings: the engine's own step on a small proxy, under simulated streams.

A proxy of `PROXY_LAYERS` equal linear layers (behind a tied embedding where the model's first unit is large:
`Structure.first_unit`) trains with a plan's structure (`Structure`), one gradient bucket and `CHUNKS_PER_LAYER`
host-step chunks per layer, while `zero_offload.offload.timeline` records every op with what it waited for;
`zero_offload.estimate.step_graph` replays the recording with a plan's durations.

A structure is recorded once per engine code and torch (0.05-1.3 s on a 2-core host) and kept on disk
(`zero_offload.estimate.recording_cache`), and read once per process. The proxy trains on the CPU, where the
streams are simulated: on a machine with CUDA, and inside a distributed job (``torch.distributed`` initialised, or
``WORLD_SIZE`` > 1), it trains in a one-rank subprocess that sees no GPU. That subprocess is started once and
serves every recording the process asks for (a plan asks for dozens), so torch is imported once, not per recording.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from dataclasses import asdict, dataclass

import torch

from zero_offload.estimate import recording_cache
from zero_offload.offload import simulated, timeline
from zero_offload.offload.timeline import Timeline

__all__ = ["Structure", "recording", "close_recorder", "PROXY_LAYERS", "CHUNKS_PER_LAYER", "FIRST_UNIT_STEPS",
           "RECORDED_STEPS"]

# 16 layers, one bucket each: the last copy down after backward is 1/16 of a micro-step's copies down.
PROXY_LAYERS = 16
PROXY_WIDTH = 96
# The first unit's share is rounded to 1/16, and below 3/32 the bare proxy stands for it (its own first layer, 1/16,
# lands last): GPT-2 124M's tied embedding (31 %) is recorded as 5/16, GPT-2 XL's (5.2 %) and the 10B's (2.0 %) by
# the bare proxy. One recording per rounded share and structure: few shares, few recordings.
FIRST_UNIT_STEPS = 16
# 4 chunks per layer: the 10B GPT-2 has ~12 (613 chunks of 16M elements over 50 blocks); the copy up of the last
# chunk after the host step is then 1/32 of the copies up, not 1/613 (a slight overestimate without the delayed
# update).
CHUNKS_PER_LAYER = 4
WARMUP_STEPS = 2
RECORDED_STEPS = 3


@dataclass(frozen=True)
class Structure:
    """What shapes a step's graph (the plan's config, less its sizes).

    Attributes:
        stage: ZeRO stage (the optimizer offloaded to the host).
        offload_param: stage 3's parameter shards on the host.
        delayed: the delayed parameter update.
        accumulates: more than one micro-step per optimizer step.
        fp32: fp32 training (else bf16).
        speculative: super_offload's speculative host step during the boundary backward.
        speculated: the share of each partition it speculates (``super_offload_fraction``; below 1 in place
            after undo copies, `zero_offload.hoststep.banks`).
        first_unit: the share of the parameters in the model's first unit (a language model's input embedding,
            tied to its head in GPT-2), whose gradient is the last that backward completes; a multiple of
            1/`FIRST_UNIT_STEPS` (`first_unit_share`), 0 for the bare proxy of equal layers (its first, 1/16,
            lands last).
        grads_on_device: the gradient partition stays on the device and the host step pulls it down chunk by
            chunk (``offload_optimizer.gradients_on_device``): the copies down belong to the step, not to each
            micro-step.
    """
    stage: int
    offload_param: bool
    delayed: bool
    accumulates: bool
    fp32: bool
    speculative: bool = False
    speculated: float = 1.0
    first_unit: float = 0.0
    grads_on_device: bool = False


def _config(s: Structure, layer: int) -> dict:
    zero = {"stage": s.stage, "reduce_bucket_size": layer, "overlap_comm": True,
            "offload_optimizer": {"device": "cpu", "delayed_param_update": s.delayed, "dpu_warmup_steps": 1,
                                  "super_offload": s.speculative,
                                  **({"super_offload_fraction": s.speculated} if s.speculated < 1 else {}),
                                  **({"gradients_on_device": True} if s.grads_on_device else {}),
                                  # as many chunks per layer as a large model's step has
                                  "copy_chunk": -(-layer // CHUNKS_PER_LAYER)}}
    if s.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if s.stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 if s.accumulates else 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    if not s.fp32:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _record_here(s: Structure) -> dict:
    """Record the proxy's steps in this process: {"ops": the timeline's ops, "marks": [[first op id, step,
    micro-step]] for each recorded micro-step}. The caller's random state is left as it was, and the proxy
    engine's warnings (a bucket pool growing on its tiny buckets) are not shown."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return _record_proxy(s)


class _Tied(torch.nn.Module):
    """One use of the proxy's tied weight: the input embedding (``x @ weight``, rows mixed by the input; no
    compute op recorded, as for a lookup) or the output layer (``h @ weight.t()``), as GPT-2 ties them."""

    def __init__(self, weight: torch.nn.Parameter, transpose: bool):
        super().__init__()
        self.weight, self.transpose = weight, transpose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.t() if self.transpose else self.weight)


def _proxy(s: Structure, layer: int) -> tuple[torch.nn.Module, dict[str, int], int]:
    """(model, {module name: parameters} for the timeline, input width): `PROXY_LAYERS` equal layers, behind a
    tied embedding holding ``s.first_unit`` of the parameters where that is above 0."""
    blocks = torch.nn.Sequential(*(torch.nn.Linear(PROXY_WIDTH, PROXY_WIDTH) for _ in range(PROXY_LAYERS)))
    if not s.first_unit:
        return blocks, {str(i): layer for i in range(PROXY_LAYERS)}, PROXY_WIDTH
    rows = round(s.first_unit / (1 - s.first_unit) * PROXY_LAYERS * layer / PROXY_WIDTH)
    weight = torch.nn.Parameter(torch.randn(rows, PROXY_WIDTH) / rows ** 0.5)
    model = torch.nn.Sequential()
    model.add_module("embed", _Tied(weight, transpose=False))
    model.add_module("blocks", blocks)
    model.add_module("head", _Tied(weight, transpose=True))
    return model, {**{f"blocks.{i}": layer for i in range(PROXY_LAYERS)}, "head": rows * PROXY_WIDTH}, rows


def _record_proxy(s: Structure) -> dict:
    import zero_offload
    layer = PROXY_WIDTH * PROXY_WIDTH + PROXY_WIDTH
    gen = torch.Generator().manual_seed(0)
    model, sizes, width = _proxy(s, layer)
    dtype = torch.float32 if s.fp32 else torch.bfloat16
    marks: list[list[int]] = []
    with simulated.forced():
        engine = zero_offload.initialize(model, _config(s, layer))
        try:
            def step(tl: Timeline | None, k: int) -> None:
                for j in range(2 if s.accumulates else 1):
                    if tl is not None:
                        marks.append([len(tl.ops), k, j])
                    x = torch.randn(2, width, generator=gen).to(dtype)
                    engine.backward(engine(x).float().square().mean())
                    engine.step()
            for k in range(WARMUP_STEPS):
                step(None, k)
            with timeline.record(model, sizes) as tl:
                for k in range(RECORDED_STEPS):
                    step(tl, k)
        finally:
            engine.close()
    return {"ops": tl.to_list(), "marks": marks}


def _needs_subprocess() -> bool:
    """Whether an engine made here would not be a one-rank CPU engine: CUDA is visible (the engine would take the
    GPU, whose streams are not simulated), or this process is part of a distributed job."""
    import torch.distributed as dist
    return (torch.cuda.is_available() or (dist.is_available() and dist.is_initialized())
            or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def _recorder_env() -> dict[str, str]:
    """This process's environment, less what would make the recorder a rank or let it see a GPU."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class _FailedInRecorder(RuntimeError):
    """A recording that raised in the recorder, which answered and waits for the next one."""


class _Recorder:
    """The one-rank CPU subprocess that records: a structure as a JSON line in, {"ok": recording} or {"error":
    traceback} as a JSON line out. Its stderr goes to a file, so a chatty engine never fills a pipe."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "zero_offload.estimate.proxy_recording"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=env, text=True)

    def record(self, s: Structure) -> dict:
        try:
            self.proc.stdin.write(json.dumps(asdict(s)) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:             # the recorder has gone: its pipe is closed
            line = ""
        if not line:
            code = self.proc.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"recording the step graph of {s} failed: the recorder exited with {code}: "
                               f"{self.stderr.read()[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise _FailedInRecorder(f"recording the step graph of {s} failed: {reply['error'][-2000:]}")
        return reply["ok"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()            # end of input: the recorder's loop ends and it exits
        except OSError:                        # a request still buffered for a recorder that has gone
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


_RECORDER: _Recorder | None = None
_RECORDER_LOCK = threading.Lock()


def close_recorder() -> None:
    """End the recording subprocess, if one was started (at exit, or to free its memory sooner); the next
    recording that needs one starts it again."""
    global _RECORDER
    with _RECORDER_LOCK:
        if _RECORDER is not None:
            _RECORDER.close()
            _RECORDER = None


atexit.register(close_recorder)


def _record_elsewhere(s: Structure) -> dict:
    global _RECORDER
    env = _recorder_env()
    with _RECORDER_LOCK:
        if _RECORDER is not None and (_RECORDER.env != env or _RECORDER.proc.poll() is not None):
            _RECORDER.close()                  # the environment changed, or the recorder died: a fresh one
            _RECORDER = None
        if _RECORDER is None:
            _RECORDER = _Recorder(env)
        try:
            return _RECORDER.record(s)
        except _FailedInRecorder:
            raise
        except BaseException:
            # Dead, or interrupted between a request and its reply (which would answer the next request): gone.
            _RECORDER.proc.kill()
            _RECORDER.close()
            _RECORDER = None
            raise


@functools.lru_cache(maxsize=None)
def recording(s: Structure) -> tuple[Timeline, tuple[tuple[int, int, int], ...]]:
    """The proxy's recorded steps for ``s``: (timeline, (first op id, step, micro-step) per micro-step), made once
    per process; in the one-rank CPU recording subprocess where CUDA is visible or inside a distributed job; kept
    on disk for the next process (`zero_offload.estimate.recording_cache`).

    Raises:
        RuntimeError: the recording failed (the recorder's traceback, or its exit code and stderr, in the message).
    """
    raw = recording_cache.load(asdict(s))
    if raw is None:
        raw = _record_elsewhere(s) if _needs_subprocess() else _record_here(s)
        recording_cache.store(asdict(s), raw)
    return Timeline.from_list(raw["ops"]), tuple(tuple(m) for m in raw["marks"])


def _serve() -> None:
    """The recording subprocess's loop: a recording per line of stdin until it closes. Whatever the engine prints
    goes to stderr, so stdout carries the replies alone."""
    replies, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        try:
            reply = {"ok": _record_here(Structure(**json.loads(line)))}
        except Exception:                                  # the caller raises it, with this traceback
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
