"""How long an optimizer step takes, by a stated model: the planner's basis for the micro-batch, gradient
accumulation, activation checkpointing and the delayed parameter update (DPU, ZeRO-Offload paper arXiv
2101.06840, Sec. 5.2).

Per rank and optimizer step of ``gas`` micro-steps of ``t`` tokens each:

- **device compute of a micro-step**: ``k x N x t`` FLOPs (k = 6 for forward and backward, 8 with activation
  checkpointing's recompute; N = all parameters, data parallelism replicates the compute; attention's FLOPs,
  which grow with the sequence, count as ``L x q x s`` more parameters, and tiled compute's and Ulysses' work is
  added: `zero_offload.estimate.sequence_compute`) at
  ``gpu_flops x min(1, t / saturation_tokens)``: a micro-batch of fewer tokens than ``saturation_tokens`` leaves
  the device's matmuls short of their sustained rate and costs as much as one of ``saturation_tokens``;
- **gradient copies down** (gradients on the host): every micro-step moves this rank's reduced gradient partition
  to the host, ``P x d`` bytes at ``pcie`` bytes/s, overlapped with backward: a micro-step takes the longer of
  the two;
- **host accumulation** (gradients on the host, ``gas`` > 1, stage >= 2): each micro-step after the first adds
  the partition on the host, ``P x (d + 8)`` bytes (the staged piece, the fp32 partition read and written: 10 B
  per element in bf16) at ``host_rate x 28`` bytes/s, the host step's bandwidth. The adds run on a worker
  thread as the pieces land (`zero_offload.offload.grad_staging`, DeepSpeed's CPU accumulation), beside
  backward: such a micro-step takes ``max(compute, copy down, host add)``; the first converts its pieces on the
  same thread, no more bytes than its copy, and is not charged;
- **host step**: the fused Adam kernel streams ``8 + 4 x moment bytes + gradient bytes + d`` bytes per parameter
  of the partition (28 B for bf16 with fp32 moments, 20 B with bf16 moments, 30 B with fp32 accumulated
  gradients; with bf16 masters ``4 + 4 x moment bytes + 2``, 14 B with bf16 moments), at ``host_rate x 28``
  bytes/s (``host_rate``: the kernel's parameters/s with fp32 moments, ``host_adam``, times the share of it
  the kernel keeps beside training, ``host_load_share``: the staging thread's conversions and the copies each
  way take memory bandwidth from it, `zero_offload.calibrate.training_load`);
- **copies up**: the updated 16-bit partition, ``P x d`` bytes at ``pcie`` (none for stage 3's host shards).
- **swap-file I/O** (``offload_optimizer.device = nvme``): the host step reads and writes every state of the
  partition once (``S`` = master + moments bytes per element: 12, 8 with bf16 moments, 6 with bf16 masters too;
  a Muon group's 8); read ahead and written behind (``pipeline_read`` and ``pipeline_write``), a read and a write
  are in flight together and the step takes the longer of ``2 x P x S / nvme_duplex`` and its kernel; else the
  sum of the kernel, ``P x S / nvme_read`` and ``P x S / nvme_write``. Stage 3's parameters on
  NVMe add their write behind the step (``P x d``) and a read of each unit's shard before each of its gathers,
  forward and backward (``2 x P x d`` per micro-step, prefetched beside compute: each pass takes the longer).
- **the step**: these pieces overlap as the engine's own recorded step overlaps them: the planner replays it
  with their durations (`zero_offload.estimate.step_graph`), and ``exposed`` is the device's idle time in it.
  `step_timing` is the closed form of the same for a step without host work (``compute = first micro-step +
  (gas - 1) x later micro-step``), and of the ideal cases: without DPU ``step = compute + host``; with DPU
  ``step = compute + max(0, host - compute)``.

Not modelled: collectives between ranks other than Ulysses' all-to-alls, and the Python overhead of a micro-step.
The default figures and where they come from are in docs/estimate.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_offload.estimate.step_graph import StepGraph

__all__ = ["Assumptions", "calibrated", "TRAINING_SHARE_OF_MATMUL", "StepTiming", "EXPOSED_FRACTION",
           "MAX_GRADIENT_ACCUMULATION", "host_step_seconds",
           "host_add_seconds", "micro_step_seconds", "step_timing", "accumulation_to_hide", "nvme_io_seconds"]

# The share of a step the host step may leave exposed in a plan.
EXPOSED_FRACTION = 0.10
# The most micro-steps per optimizer step the planner chooses.
MAX_GRADIENT_ACCUMULATION = 64


@dataclass(frozen=True)
class Assumptions:
    """The throughput figures the step model uses (defaults: docs/estimate.md says where each comes from).

    Attributes:
        gpu_flops: sustained bf16 FLOP/s of one accelerator in training.
        host_adam: parameters/s of the host Adam step with fp32 moments and a bf16 gradient (28 bytes/param);
            other layouts scale by their bytes per parameter.
        pcie: bytes/s of host <-> device copies, each direction, per accelerator.
        nvme_read, nvme_write: bytes/s of one rank's swap-file reads and writes (O_DIRECT, sequential).
        nvme_duplex: bytes/s of its reads and writes together, a read and a write in flight at once.
        host_load_share: the share of ``host_adam`` the host step keeps beside training (the staging thread's
            conversions and the copies each way share the host's memory bandwidth with it): the step is
            charged at `host_rate`, ``host_adam x host_load_share``, under every policy (measured under the
            delayed update, the heaviest load; a synchronous step overlaps only its copies up: an assumption).
        saturation_tokens: tokens per micro-batch from which the device reaches ``gpu_flops``.
        interconnect: bytes/s a rank's all-to-all moves to the other ranks of its machine (Ulysses,
            `zero_offload.estimate.sequence_compute`).
        source: where the figures come from ("built-in", or the calibration file: `zero_offload.calibrate`).

    Raises:
        ValueError: a figure <= 0 (the message names it).
    """
    gpu_flops: float = 4.0e14
    host_adam: float = 4.2e9
    pcie: float = 25e9
    saturation_tokens: int = 8192
    interconnect: float = 300e9
    nvme_read: float = 2.5e9
    nvme_write: float = 2.5e9
    nvme_duplex: float = 2.5e9
    host_load_share: float = 0.77
    source: str = "built-in"

    def __post_init__(self) -> None:
        for name in ("gpu_flops", "host_adam", "pcie", "saturation_tokens", "nvme_read", "nvme_write",
                     "nvme_duplex", "interconnect"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        share = self.host_load_share
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
            raise ValueError(f"host_load_share must be in (0, 1], got {self.host_load_share!r}")

    @property
    def host_rate(self) -> float:
        """Parameters/s of the host step beside training (fp32 moments): ``host_adam x host_load_share``."""
        return self.host_adam * self.host_load_share


# A training step's sustained FLOP/s as a share of the square bf16 matmul's (the step model's ``gpu_flops``): the
# share a checkpointed GPT-2 forward and backward reach (8 x N x tokens FLOPs over their device time against the
# calibrated matmul peak; the measurement is in BENCHMARKS.md, "the seed's 10B GPT-2").
TRAINING_SHARE_OF_MATMUL = 0.78


def calibrated(calibration=None) -> Assumptions:
    """The step model's figures and where they came from: the file ``calibration`` (written by ``zero-offload
    calibrate``, `zero_offload.calibrate`) when given, else the file at its default path when it exists, else the
    built-in `Assumptions`. A measured rate replaces its built-in one: ``gpu_flops`` = `TRAINING_SHARE_OF_MATMUL`
    x the matmul FLOP/s, ``pcie`` = the slower copy direction, ``host_adam`` = the kernel's parameters/s,
    ``host_load_share`` = its share kept beside training,
    ``nvme_read`` / ``nvme_write`` / ``nvme_duplex`` = the swap directory's measured rates (``calibrate
    --nvme-path``); a rate
    the file lacks (a host without a GPU) keeps the built-in one. ``source`` names the file or says "built-in".

    Raises:
        CalibrationError: ``calibration`` names a file that is missing or malformed (`zero_offload.calibrate.load`);
            a default file that is malformed raises too (it was written for this machine, and ignoring it would
            plan with other figures than the user measured).
    """
    from pathlib import Path

    from zero_offload.calibrate import default_path, load
    path = Path(calibration) if calibration is not None else default_path()
    if calibration is None and not path.exists():
        return Assumptions()
    c = load(path)
    measured = {"gpu_flops": c["matmul_bf16_flops"] and c["matmul_bf16_flops"] * TRAINING_SHARE_OF_MATMUL,
                "host_adam": c["host_adam_params_per_s"], "host_load_share": c.get("host_load_share"),
                "pcie": min(c["h2d_bytes_per_s"], c["d2h_bytes_per_s"])
                if c["h2d_bytes_per_s"] and c["d2h_bytes_per_s"] else None,
                "nvme_read": c.get("nvme_read_bytes_per_s"), "nvme_write": c.get("nvme_write_bytes_per_s"),
                "nvme_duplex": c.get("nvme_duplex_bytes_per_s")}
    kept = sorted(k for k, v in measured.items() if not v)
    return Assumptions(**{k: v for k, v in measured.items() if v},
                       source=f"calibration {path}" + (f" (built-in {', '.join(kept)})" if kept else ""))


def host_step_seconds(params: int, moment_bytes: int, grad_bytes: int, param_bytes: int, host_adam: float,
                      master_bytes: int = 4) -> float:
    """Seconds of one host Adam step over ``params`` elements: its bytes per parameter over the kernel's
    bandwidth, ``host_adam`` params/s x 28 bytes (the measured layout). ``param_bytes``: the 16-bit output (0 with
    bf16 masters, ``master_bytes`` 2: the master is the parameter)."""
    return params * (2 * master_bytes + 4 * moment_bytes + grad_bytes + param_bytes) / (host_adam * 28)


def nvme_io_seconds(read_bytes: int, write_bytes: int, a: Assumptions, together: bool = False) -> float:
    """Seconds of ``read_bytes`` read from and ``write_bytes`` written to one rank's swap files: one direction
    after the other, or ``together`` (a read ahead in flight beside a write behind) at the drive's duplex rate
    while both run and at one direction's alone for the rest."""
    if not together:
        return read_bytes / a.nvme_read + write_bytes / a.nvme_write
    both = min(read_bytes, write_bytes)
    rest = read_bytes - both if read_bytes > both else write_bytes - both
    return 2 * both / a.nvme_duplex + rest / (a.nvme_read if read_bytes > both else a.nvme_write)


# Bytes per element of Muon's partition work on the host (`zero_offload.hoststep.muon`), besides the d of the gradient
# read and of the parameters written: the native momentum pass (momentum read and written, the update written: 12),
# the results zeroed (4), the update's pieces gathered for the owners (8) and the results written back (4), the
# native update pass (master and result read, master written: 12), the masters read for the parameters (4); the
# host's bandwidth is host_rate x 28 B.
MUON_PASS_BYTES = 44


def muon_step_seconds(part: int, matrices, gpus: int, d: int, a: "Assumptions") -> float:
    """Seconds of the Muon groups' step on one rank (`zero_offload.hoststep.muon.PartitionedMuon`): its partition
    work over ``part`` elements on the host, the owners' Newton-Schulz of ``matrices`` (shapes) on the device at
    ``gpu_flops`` (spread evenly over ``gpus`` owners), and the update up (4 B) and the result down (``d`` B) over
    the device link per element; run one after the other, on the training thread."""
    from zero_offload.optim.muon import ns_flops
    host = part * (MUON_PASS_BYTES + 2 * d) / (a.host_rate * 28)
    ns = sum(ns_flops(m) for m in matrices) / gpus / a.gpu_flops
    return host + ns + part * (4 + d) / a.pcie


def host_add_seconds(params: int, piece_bytes: int, host_adam: float, sum_bytes: int = 4) -> float:
    """Seconds of one micro-step's host accumulation into a gradient partition of ``params`` elements: the staged
    piece (``piece_bytes`` per element) read, the partition (fp32, or bf16 with bf16 masters: ``sum_bytes``) read
    and written (10 B per element in bf16), at the host step's bandwidth, ``host_adam`` params/s x 28 bytes."""
    return params * (piece_bytes + 2 * sum_bytes) / (host_adam * 28)


# Stage 3's gather and release of one unit, in forward or in backward, in seconds: the difference between stage 3 +
# offload's and stage 2 + offload's device time per micro-step over GPT-2 124M's 123 units (BENCHMARKS.md, "GPT-2
# 124M"). Counted on top of the compute, as measured there.
STAGE3_UNIT_SECONDS = 2.2e-4


def micro_step_seconds(n_params: int, tokens: int, checkpointing: bool, a: Assumptions,
                       grad_down_bytes: int = 0, host_add_s: float = 0.0, stage3_units: int = 0,
                       param_read_s: float = 0.0) -> float:
    """Seconds of one micro-step of ``tokens`` tokens: device compute (with the saturation rule) plus stage 3's
    gathers and releases of ``stage3_units`` units (twice each: `STAGE3_UNIT_SECONDS`), or the copy of
    ``grad_down_bytes`` of gradients to the host, or the ``host_add_s`` seconds of its host accumulation
    (`host_add_seconds`; 0 for the first micro-step of a step), or the ``param_read_s`` seconds of stage 3's
    parameters read from NVMe, whichever is longest: all of them overlap."""
    rate = a.gpu_flops * min(1.0, tokens / a.saturation_tokens)
    compute = (8 if checkpointing else 6) * n_params * tokens / rate + 2 * stage3_units * STAGE3_UNIT_SECONDS
    return max(compute, grad_down_bytes / a.pcie, host_add_s, param_read_s)


@dataclass(frozen=True)
class StepTiming:
    """One optimizer step by the model above, per rank.

    Attributes:
        micro_s: seconds of the first micro-step; compute_s: of all ``gas`` of them.
        host_s: seconds of the host step (0: the step runs on the device).
        delayed: the host step runs beside the next step's compute (DPU).
        exposed_s: seconds the device waits on the host step and the copies; step_s: seconds per optimizer step.
        tokens: tokens per optimizer step and rank.
    """
    micro_s: float
    compute_s: float
    host_s: float
    delayed: bool
    exposed_s: float
    step_s: float
    tokens: int
    later_micro_s: float | None = None    # seconds of each micro-step after the first (None: ``micro_s``)
    graph: "StepGraph | None" = None      # the replayed timeline it comes from (`zero_offload.estimate.step_graph`)

    @property
    def exposed_share(self) -> float:
        """The share of the step the device waits on the host step (0 to 1)."""
        return self.exposed_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second and rank."""
        return self.tokens / self.step_s if self.step_s > 0 else 0.0


def step_timing(micro_s: float, gas: int, host_s: float, delayed: bool, tokens: int,
                later_micro_s: float | None = None) -> StepTiming:
    """The step of ``gas`` micro-steps -- the first of ``micro_s`` seconds, the others of ``later_micro_s``
    (default ``micro_s``; longer where the host accumulation is) -- and a host step of ``host_s`` seconds,
    delayed (DPU) or not, carrying ``tokens`` tokens per rank."""
    later = micro_s if later_micro_s is None else later_micro_s
    compute = micro_s + (gas - 1) * later
    exposed = max(0.0, host_s - compute) if delayed else host_s
    return StepTiming(micro_s, compute, host_s, delayed, exposed, compute + exposed, tokens, later)


# The device part of offload_optimizer.ratio < 1: torch's fused AdamW reads and writes ~32 bytes per parameter (fp32
# master and moments, the gradient, the 16-bit parameter) at about this device-memory rate (a share of an H100's
# 3.35 TB/s; the planner's figure, not measured here).
DEVICE_ADAM_BYTES_PER_S = 2.0e12
DEVICE_ADAM_BYTES_PER_PARAM = 32


def device_step_seconds(params: int) -> float:
    """Seconds of the device's fused AdamW over ``params`` parameters (`DEVICE_ADAM_BYTES_PER_S`)."""
    return params * DEVICE_ADAM_BYTES_PER_PARAM / DEVICE_ADAM_BYTES_PER_S


# The speculative kernel (super_offload) writes a second bank of state: streaming stores, 1.2-1.25x the in-place
# kernel's time (benchmarks/bench_speculative_kernel.py, AVX-512 and AVX2; BENCHMARKS.md).
SPECULATIVE_KERNEL_COST = 1.25
# super_offload_fraction < 1 copies the speculated share's master weights and moments out before stepping it in
# place: the copy takes 0.8x (bf16 moments) to 1.7x (fp32) the in-place step's time (torch's copy reads each
# destination line before writing it; benchmarks/bench_speculative_kernel.py, BENCHMARKS.md). The larger is used.
UNDO_COPY_COST = 1.7


def accumulation_to_hide(micro_s: float, host_s: float, delayed: bool,
                         exposed_fraction: float = EXPOSED_FRACTION) -> int:
    """The fewest micro-steps per optimizer step that leave at most ``exposed_fraction`` of the step to the
    host step: with DPU ``gas x micro_s >= (1 - f) x host_s``; without, ``host_s <= f x (gas x micro_s +
    host_s)``. May exceed `MAX_GRADIENT_ACCUMULATION` (the caller caps it)."""
    if host_s <= 0:
        return 1
    f = exposed_fraction
    need = (1 - f) * host_s if delayed else host_s * (1 - f) / f
    return max(1, math.ceil(need / micro_s - 1e-9))
