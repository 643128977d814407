"""The planner's choice of micro-batch, gradient accumulation, activation checkpointing and how the host step is
hidden -- the delayed parameter update, ``super_offload``'s speculative step, or neither -- for one ZeRO config
(`zero_offload.estimate.planner` calls `choose_batch` per candidate).

Every setting tried is checked against memory with the engine's own model (`estimate_memory`), with the delayed
update's spare gradient partition, super_offload's second bank of state and the gradient staging of accumulation
counted, so a plan never turns on something that does not fit. Among the settings that fit, the step model of
`zero_offload.estimate.throughput` predicts tokens/s; the plan takes the best prediction, and among predictions
equal to within `TIE` (rounding, not a margin: a margin would let more memory, which adds settings, predict a
slower plan) the fewest tokens per optimizer step (larger batches than needed change the training, not only its
speed), then checkpointing off, then the delayed update off (no stale step), then super_offload off (no second
bank), then the larger micro-batch.

Exact by default: the delayed update trains every step on parameters one step old, so the plan chooses it only
where the config asks for it, or the caller allows a stale step (`Knobs.allow_stale_step`; ``zero-offload
estimate --allow-stale-step``) and it gains more than `NOTABLE_GAIN` over the same micro-batch without it.
Otherwise it is still predicted, and the notes say what it would gain.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

from zero_offload.config import Config
from zero_offload.estimate.batch_choice import BatchChoice, Knobs
from zero_offload.estimate.batch_notes import NOTABLE_GAIN, RATIOS, explain
from zero_offload.estimate.checkpoint_modes import (checkpoint_modes, input_copy_exposure, move_blocks,
                                                    split_inputs, with_inputs_on_host)
from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.estimate.memory import MemoryEstimate, ModelShape
from zero_offload.estimate.sequence_compute import attention_params, tiled_recompute_params, ulysses_seconds
from zero_offload.estimate.step_graph import Phases, Structure, first_unit_share, predict_step
from zero_offload.estimate.throughput import (MAX_GRADIENT_ACCUMULATION, STAGE3_UNIT_SECONDS,
                                              Assumptions, StepTiming, accumulation_to_hide, host_add_seconds,
                                              SPECULATIVE_KERNEL_COST, UNDO_COPY_COST, device_step_seconds,
                                              host_step_seconds, micro_step_seconds, muon_step_seconds,
                                              nvme_io_seconds, step_timing)
from zero_offload.zero.flat import partition_numel
from zero_offload.zero.grad_partition import accumulates_fp32

__all__ = ["Knobs", "BatchChoice", "choose_batch", "MICRO_BATCHES", "TIE"]

# Micro-batch sizes the planner tries when it chooses one.
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Predicted throughputs this close (relative) count as equal: float rounding only. The choice is the best predicted
# throughput, so that more memory, which only adds settings that fit, never predicts a slower plan.
TIE = 1e-9
# super_offload_fraction's grid where the planner sizes it (below it: no speculation).
FRACTION_STEP = 0.0625

# (estimate, {side: bytes short}) of a config dict at a micro-batch and checkpointing setting.
Measure = Callable[[dict, int, "bool | None"], "tuple[MemoryEstimate, dict[str, int]]"]


def _with(raw: dict, micro: int, gas: int, policy: tuple, fraction: float | None = None) -> dict:
    out = copy.deepcopy(raw)
    out.pop("train_batch_size", None)
    out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"] = micro, gas
    offload = out["zero_optimization"].get("offload_optimizer")
    for key, on in zip(("delayed_param_update", "super_offload"), policy[:2]):
        if on and isinstance(offload, dict):
            offload[key] = True
        elif on is False and isinstance(offload, dict):
            offload.pop(key, None)          # off is the default
    if isinstance(offload, dict) and (fraction is not None or not policy[1]):
        offload.pop("super_offload_fraction", None)         # 1 is the default, and needs super_offload
        if fraction is not None and fraction < 1.0:
            offload["super_offload_fraction"] = fraction
    if isinstance(offload, dict) and policy[2] is not None:
        offload["ratio"] = policy[2]
        if policy[2] == 1.0:
            offload.pop("ratio")            # 1 is the default
    return out


def _sized_fraction(est: MemoryEstimate, short: dict[str, int]) -> float:
    """The largest ``super_offload_fraction`` on the `FRACTION_STEP` grid whose undo bank and 16-bit staging would
    fit where the full second bank and the partition-sized staging (``est``'s ``speculative_state`` and
    ``param_staging``, both scaling with the fraction) leave the host ``short``; 0 where something else is
    short. The caller checks it (the ring and pinned rounding aside)."""
    scaled = est.host.get("speculative_state", 0) + est.host.get("param_staging", 0)
    if not scaled or any(v for k, v in short.items() if k != "host"):
        return 0.0
    return math.floor((scaled - short.get("host", 0)) / scaled / FRACTION_STEP) * FRACTION_STEP


def _hiding_fraction(t: StepTiming, checkpointing: bool) -> float | None:
    """The ``super_offload_fraction`` (on the `FRACTION_STEP` grid) whose pieces the host can step in place during
    one backward, undo copies included; None where that is all of it or none. Speculating more than that is
    exposed anyway, at the undo copies' cost; the whole second bank avoids the copies but writes a second bank."""
    backward_s = t.micro_s * (6 / 8 if checkpointing else 4 / 6)      # backward's share of the model's FLOPs
    share = math.floor(backward_s / (t.host_s * (1 + UNDO_COPY_COST)) / FRACTION_STEP) * FRACTION_STEP
    return share if FRACTION_STEP <= share < 1.0 else None


def _policies(knobs: Knobs, dpu_possible: bool, spec_possible: bool, ratio_possible: bool) -> list[tuple]:
    """How the host step may be hidden, as (delayed update, super_offload, ratio), the default first (a fixed knob
    is kept; None: not applicable). The delayed update combines with neither of the others."""
    dpu = [knobs.delayed_update] if knobs.delayed_update is not None else ([False, True] if dpu_possible else [None])
    spec = [knobs.super_offload] if knobs.super_offload is not None else ([False, True] if spec_possible else [None])
    ratios = [knobs.ratio] if knobs.ratio is not None else (list(RATIOS) if ratio_possible else [None])
    return [(d, s, r) for r in ratios for d in dpu for s in spec
            if not (d and s) and not (d and r is not None and r < 1.0)]


def _host_step(shape: ModelShape, cfg: Config, gpus: int, gas: int, a: Assumptions) -> tuple[float, int, float]:
    """(host-step seconds, gradient bytes copied down per micro-step, host-accumulation seconds of each micro-step
    after the first) of this rank; (0, 0, 0) when the step runs on the device."""
    zc = cfg.zero_optimization
    offload_param = zc.stage == 3 and zc.offload_param.device in ("cpu", "nvme")
    if zc.offload_optimizer.device not in ("cpu", "nvme") and not offload_param:
        return 0.0, 0, 0.0
    d = 4 if cfg.precision == "fp32" else 2
    parts = [partition_numel(n, gpus) for n in shape.group_numels()]
    part = sum(parts)
    muon = sum(parts[g] for g in shape.muon_groups)         # type Muon: its groups' step (`muon_step_seconds`)
    moments = 2 if cfg.bf16.bf16_optimizer_states else 4
    bf16_masters = cfg.bf16.bf16_master_weights_and_grads      # the master is the 16-bit parameter: no output
    accumulates = gas > 1 and zc.stage >= 2          # partitions added into: fp32, or bf16
    grad = 4 if accumulates and not bf16_masters else d
    on_device = zc.offload_optimizer.gradients_on_device      # added into on the device, pulled down by the step
    add_s = host_add_seconds(part, d, a.host_rate, grad) if accumulates and not on_device else 0.0
    step_s = host_step_seconds(part - muon, moments, grad, 0 if bf16_masters else d, a.host_rate,
                               2 if bf16_masters else 4)
    if muon:
        step_s += muon_step_seconds(muon, shape.muon_matrices, gpus, d, a)
    oo = zc.offload_optimizer
    param_nvme = offload_param and zc.offload_param.device == "nvme"
    if oo.device == "nvme" or param_nvme:
        # Swap files: every state read and written once (a Muon group's master and momentum), and stage 3's
        # parameters written behind the step; streamed beside the kernel when read ahead and written behind.
        states = (part - muon) * ((2 if bf16_masters else 4) + 2 * moments) + muon * 8 if oo.device == "nvme" else 0
        overlapped = oo.device != "nvme" or (oo.pipeline_read and oo.pipeline_write)
        io_s = nvme_io_seconds(states, states + (part * d if param_nvme else 0), a, together=overlapped)
        step_s = max(step_s, io_s) if overlapped else step_s + io_s
    return step_s, part * d, add_s


def choose_batch(shape: ModelShape, raw: dict, gpus: int, seq: int | None, knobs: Knobs, a: Assumptions,
                 measure: Measure) -> BatchChoice:
    """The best setting of the free knobs for config ``raw`` on ``gpus`` ranks (see the module docstring), or,
    when even the smallest setting does not fit, that smallest setting (``fits`` False, ``short`` says where).

    ``seq`` None (no sequence length known) or fixed knobs only: the fixed setting, checked, with no timing.
    """
    base = Config.load(raw)
    gas0 = knobs.gradient_accumulation or 1
    free_ckpt = knobs.checkpointing is None and knobs.choose_checkpointing and shape.gpt is not None
    ckpts = [False, True] if free_ckpt else [knobs.checkpointing]
    own = bool((shape.gpt and shape.gpt.activation_checkpointing) or (shape.decoder and
                                                                       shape.decoder.activation_checkpointing))
    modes = checkpoint_modes(ckpts, raw, own)
    micros = list(MICRO_BATCHES) if knobs.micro_batch is None else [knobs.micro_batch]
    zc = base.zero_optimization
    streamed = zc.offload_optimizer.gradients_on_device      # the synchronous host step only
    dpu_possible = (zc.offload_optimizer.device == "cpu" and not (zc.stage == 3 and zc.offload_param.device != "none")
                    and not streamed)
    spec_possible = (zc.offload_optimizer.device in ("cpu", "nvme") and zc.stage >= 2
                     and zc.offload_param.device != "nvme" and not streamed)
    sized = zc.offload_optimizer.device == "cpu"         # a share of super_offload's bank: host memory only
    ratio_possible = (spec_possible and zc.offload_param.device == "none"
                      and not base.bf16.bf16_master_weights_and_grads)       # not built with bf16 masters
    policies = _policies(knobs, dpu_possible, spec_possible, ratio_possible)
    default = policies[0]

    def make(micro: int, gas: int, mode: tuple, policy, fraction: float | None = None) -> BatchChoice:
        ckpt, on_host = mode
        cfg_raw = with_inputs_on_host(_with(raw, micro, gas, policy, fraction), on_host)
        est, short = measure(cfg_raw, micro, ckpt)
        if on_host:
            cfg_raw, est, short = split_inputs(cfg_raw, est, short, gpus, lambda r: measure(r, micro, ckpt))
        elif shape.decoder is not None:         # whole blocks to the host where the device cannot keep them all
            cfg_raw, est, short = move_blocks(cfg_raw, est, short, shape.decoder.layers,
                                              lambda r: measure(r, micro, ckpt))
        given = fraction if fraction is not None else knobs.super_offload_fraction     # else the default, 1
        c = BatchChoice(cfg_raw, micro, gas, ckpt, bool(policy[0]), bool(policy[1]),
                        1.0 if policy[2] is None else policy[2], est, short, fraction=given or 1.0,
                        inputs_on_host=on_host)
        if c.fits or not policy[1] or fraction is not None or knobs.super_offload_fraction is not None or not sized:
            return c
        # The full second bank does not fit: speculate the largest share whose undo bank does.
        share = _sized_fraction(est, short)
        while share >= FRACTION_STEP:
            smaller = make(micro, gas, mode, policy, share)
            if smaller.fits:
                return smaller
            share -= FRACTION_STEP
        return c

    smallest = make(micros[0], gas0, modes[-1], default)
    if not smallest.fits or seq is None:
        return smallest
    options: list[BatchChoice] = []
    plain: dict[tuple, BatchChoice] = {}       # (micro, mode) -> the default policy's setting
    for mode in modes:
        ckpt = mode[0]
        for micro in micros:
            first = make(micro, gas0, mode, default)
            if not first.fits:
                break                          # activations only grow with the micro-batch
            options.append(_timed(first, shape, gpus, seq, a, knobs.tiles))
            plain[micro, mode] = first
            for policy in policies:
                gases = {gas0}
                if knobs.gradient_accumulation is None:
                    need = accumulation_to_hide(first.timing.micro_s, first.timing.host_s, bool(policy[0]))
                    gases.add(min(MAX_GRADIENT_ACCUMULATION, need))
                for gas in sorted(gases):
                    shares = [] if policy == default and gas == gas0 else [None]      # that one is `first`
                    if policy[1] and knobs.super_offload_fraction is None and sized:
                        shares.append(_hiding_fraction(first.timing, bool(ckpt)))
                    for share in shares:
                        c = make(micro, gas, mode, policy, share)
                        if c.fits and (share is None or c.fraction < 1.0):
                            options.append(_timed(c, shape, gpus, seq, a, knobs.tiles))
    # The delayed update is predicted always, chosen only where asked for, or allowed and worth a stale step: more
    # than `NOTABLE_GAIN` over the default policy's setting of its micro-batch, which fits wherever it fits (so the
    # rule does not depend on memory, and more memory still never predicts a slower plan).
    def worth(c: BatchChoice) -> bool:
        twin = plain[c.micro, (c.checkpointing, c.inputs_on_host)]
        return c.timing.tokens_per_s > (1 + NOTABLE_GAIN) * twin.timing.tokens_per_s
    allowed = [c for c in options if not c.delayed or knobs.delayed_update or (knobs.allow_stale_step and worth(c))]
    if not allowed:
        return smallest
    best = max(c.timing.tokens_per_s for c in allowed)
    near = [c for c in allowed if c.timing.tokens_per_s >= (1 - TIE) * best]
    chosen = min(near, key=lambda c: (c.timing.tokens, bool(c.checkpointing), c.inputs_on_host, c.delayed,
                                      c.speculative, -c.ratio, -c.micro))
    chosen.notes = explain(chosen, options, seq, free_ckpt, knobs, dpu_possible, spec_possible, ratio_possible, a)
    return chosen


def _timed(c: BatchChoice, shape: ModelShape, gpus: int, seq: int, a: Assumptions,
           tiles: SequenceTiles | None = None) -> BatchChoice:
    """``c`` with its predicted step: each kind of work's seconds by `zero_offload.estimate.throughput`, overlapped
    as the engine's recorded step overlaps them (`zero_offload.estimate.step_graph`); attention, ``tiles``' recompute
    and Ulysses' all-to-alls by `zero_offload.estimate.sequence_compute`."""
    cfg = Config.load(c.raw)
    zc = cfg.zero_optimization
    host_s, down, add_s = _host_step(shape, cfg, gpus, c.gas, a)
    # The host's part; super_offload writes a second bank (streaming stores), or below fraction 1 copies the
    # speculated share out first (the undo copies of the whole partition: `Phases.save_s`) and steps it in place.
    undo = c.speculative and c.fraction < 1.0
    save_s = UNDO_COPY_COST * host_s * c.ratio if undo else 0.0
    host_s *= (SPECULATIVE_KERNEL_COST if c.speculative and not undo else 1.0) * c.ratio
    sp = cfg.sequence_parallel_size
    tokens = c.micro * seq // sp                      # this rank's: Ulysses splits each sequence over sp ranks
    ckpt = c.checkpointing if c.checkpointing is not None else bool(shape.gpt and shape.gpt.activation_checkpointing)
    units = len(shape.units) if zc.stage == 3 else 0
    # Stage 3's parameters on NVMe: each unit's shard read before its gather, forward and backward, prefetched
    read_s = nvme_io_seconds(down, 0, a) if zc.stage == 3 and zc.offload_param.device == "nvme" else 0.0
    # Gradients kept on the device: nothing goes down in a micro-step; the host step pulls the partition down
    on_device = zc.offload_optimizer.gradients_on_device
    per_micro = 0 if on_device else down
    d = 4 if cfg.precision == "fp32" else 2
    pulled = down * (4 // d if zc.stage >= 2 and accumulates_fp32(cfg, c.gas) else 1)    # the partition's bytes
    n = shape.n_params + attention_params(shape, seq)     # attention's FLOPs as parameters (sequence_compute)
    flops = a.gpu_flops * min(1.0, tokens / a.saturation_tokens)
    # Beside the k x N x t: the tiles' forward again in backward, and Ulysses' all-to-alls (attention waits on them)
    sequence_s = (2 * tiled_recompute_params(shape, tiles) * tokens / flops
                  + ulysses_seconds(shape, tokens, sp, d, ckpt, a.interconnect))
    micro_s = micro_step_seconds(n, tokens, ckpt, a, per_micro, stage3_units=units,
                                 param_read_s=2 * read_s) + sequence_s
    later_s = micro_step_seconds(n, tokens, ckpt, a, per_micro, add_s, units, 2 * read_s) + sequence_s
    # Checkpoint inputs and cpu_layers' activations in host memory: their copies each way, beside forward and backward.
    moved = c.estimate.host.get("checkpoint_inputs", 0) + c.estimate.host.get("layer_activations", 0)
    extra_f, extra_b = input_copy_exposure(moved, a.pcie, 2 * n * tokens / flops,
                                           (6 if ckpt else 4) * n * tokens / flops)
    micro_s, later_s = micro_s + extra_f + extra_b, later_s + extra_f + extra_b
    if not host_s:
        c.timing = step_timing(micro_s, c.gas, 0.0, False, tokens * c.gas, later_s)
        return c
    gathers = units * STAGE3_UNIT_SECONDS
    forward = max(2 * n * tokens / flops + gathers, read_s) + extra_f
    backward = max((6 if ckpt else 4) * n * tokens / flops + gathers, read_s) + extra_b + sequence_s
    offload_param = zc.stage == 3 and zc.offload_param.device in ("cpu", "nvme")
    structure = Structure(zc.stage, offload_param, c.delayed, c.gas > 1, cfg.precision == "fp32", c.speculative,
                          c.fraction if c.speculative else 1.0, first_unit_share(shape),
                          zc.offload_optimizer.gradients_on_device)
    up = 0.0 if offload_param else down / a.pcie          # host shards are written in place, gathered later
    graph = predict_step(structure, Phases(forward, backward, (pulled if on_device else down) / a.pcie, up, add_s,
                                           host_s, c.gas, save_s))
    # ratio < 1: the device part's step is queued at the boundary before the host steps its part (counted in
    # full: the recorded proxy has no device step to overlap it with).
    device_s = device_step_seconds(int(shape.n_params / gpus * (1.0 - c.ratio)))
    c.timing = StepTiming(micro_s, graph.compute_s + device_s, host_s, c.delayed, graph.idle_s,
                          graph.step_s + device_s, tokens * c.gas, later_s, graph)
    return c
