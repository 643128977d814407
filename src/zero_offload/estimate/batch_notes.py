"""The reasons a plan gives for its batch setting (`zero_offload.estimate.batching.choose_batch`): the batch, and
why activation checkpointing, the delayed update, super_offload and the offloaded share are on or off."""
from __future__ import annotations

from zero_offload.config import Config
from zero_offload.estimate.batch_choice import BatchChoice, Knobs
from zero_offload.estimate.throughput import EXPOSED_FRACTION, Assumptions

__all__ = ["NOTABLE_GAIN", "RATIOS", "explain"]

# How much faster a setting not chosen must be for the notes to name it (the delayed update's gain), and for the
# plan to take a stale step it is allowed (`choose_batch`).
NOTABLE_GAIN = 0.03
# offload_optimizer.ratio values the planner tries when it chooses one (the share of the state offloaded).
RATIOS = (1.0, 0.9, 0.75, 0.5, 0.25)


def explain(c: BatchChoice, options: list[BatchChoice], seq: int, free_ckpt: bool, knobs: Knobs,
             dpu_possible: bool, spec_possible: bool, ratio_possible: bool, a: Assumptions) -> dict[str, str]:
    t = c.timing
    zc = Config.load(c.raw).zero_optimization
    states_on_nvme = zc.offload_optimizer.device == "nvme"
    on_nvme = states_on_nvme or (zc.stage == 3 and zc.offload_param.device == "nvme")
    notes = {"batch": (f"micro-batch {c.micro} x {seq} tokens, gradient accumulation {c.gas}: {t.tokens:,} tokens "
                       f"per optimizer step and rank ({'chosen' if knobs.micro_batch is None else 'given'} "
                       f"micro-batch, {'chosen' if knobs.gradient_accumulation is None else 'given'} "
                       f"accumulation; the best predicted throughput, the fewest tokens per step among "
                       f"equal ones)")}
    if knobs.gradient_accumulation is None and t.exposed_share > EXPOSED_FRACTION and c.gas == 1 and \
            not any(o.gas > 1 for o in options):
        notes["batch"] += ("; more accumulation does not fit: it keeps the gradient partition in fp32 (2 more "
                           "host bytes per parameter) and adds the gradient staging")
    if free_ckpt:
        other = [o for o in options if o.checkpointing != c.checkpointing]
        alt = max(other, key=lambda o: o.timing.tokens_per_s, default=None)
        if c.checkpointing:
            why = ("without it the largest micro-batch that fits is "
                   f"{max(o.micro for o in other)} (~{alt.timing.tokens_per_s:,.0f} tokens/s predicted)"
                   if alt is not None else "without it not even micro-batch 1 fits")
            notes["activation_checkpointing"] = f"on (recompute each block in backward): {why}"
            if c.inputs_on_host:
                notes["activation_checkpointing"] += (
                    f"; the block inputs wait in host memory (activation_checkpointing.cpu_checkpointing: "
                    f"{c.estimate.host.get('checkpoint_inputs', 0) / 2**30:.1f} GiB each way per micro-step, beside "
                    f"the compute)")
        else:
            notes["activation_checkpointing"] = "off: the chosen micro-batch fits without recomputing activations"
    if placed := _placement(c):
        notes["activation_checkpointing"] = "; ".join(filter(None, [notes.get("activation_checkpointing"), placed]))
    if dpu_possible and t.host_s > 0:
        if c.delayed:
            spare = c.gas > 1 and Config.load(c.raw).zero_optimization.stage >= 2
            held = ("its spare fp32 gradient partition and the 16-bit partition it publishes from counted in host "
                    "memory" if spare else "the gradient buffer lent to it, the next backward refilling it behind "
                    "it: no spare partition")
            notes["delayed_param_update"] = ("on: the host step runs one step behind, beside the next step's "
                                             f"forward and backward ({held}; the buffers its step lands the "
                                             "parameters in counted in device memory)")
        elif knobs.delayed_update is None:
            dpu = [o for o in options if o.delayed]
            fastest = max(dpu, key=lambda o: o.timing.tokens_per_s, default=None)
            gain = fastest.timing.tokens_per_s / t.tokens_per_s - 1 if fastest is not None else 0.0
            if fastest is not None and not knobs.allow_stale_step and gain > NOTABLE_GAIN:
                notes["delayed_param_update"] = (
                    f"off: exact by default (it trains each step on parameters one step old); allowed "
                    f"(--allow-stale-step, plan(allow_stale_step=True)) it would reach "
                    f"~{fastest.timing.tokens_per_s:,.0f} tokens/s, {gain:+.0%}")
            else:
                notes["delayed_param_update"] = ("off: the host step hides well enough without it" if dpu else
                                                 "off: with it the config does not fit (its spare gradient "
                                                 "partition, and under accumulation a 16-bit publish buffer, need "
                                                 "host memory that is not there, or its device landing buffers "
                                                 "device memory)")
    if spec_possible and t.host_s > 0:
        if c.speculative:
            bank = ("its second bank of master weights and moments" if c.fraction >= 1.0 else
                     f"{c.fraction:g} of each partition, the first to land, stepped in place after an undo copy: as "
                     "much as the host steps during backward, or as fits; that copy")
            where = "a second set of swap files" if states_on_nvme else "host memory"
            notes["super_offload"] = ("on: the boundary's host step starts during its backward, kept exactly or "
                                      f"redone where clipping fires ({bank} counted in {where}, its landing "
                                      "buffers in device memory)")
        elif knobs.super_offload is None:
            spec = [o for o in options if o.speculative]
            notes["super_offload"] = ("off: it does not hide enough more of the host step to pay for its memory" if
                                      spec else "off: its second bank of master weights and moments does not fit "
                                      "in host memory (or its landing buffers in device memory)")
    if ratio_possible and t.host_s > 0 and knobs.ratio is None:
        notes["ratio"] = (f"{c.ratio:g}: " + ("the whole optimizer state on the host" if c.ratio == 1.0 else
                          f"{1 - c.ratio:.0%} of each partition keeps its master weights, moments and gradient on "
                          "the device (counted in device memory) and is stepped there, beside the host's part")
                          + f" (tried {', '.join(f'{r:g}' for r in RATIOS)}: the fastest that fits)")
    share = f"{t.exposed_share:.0%}"
    notes["step"] = (f"~{t.step_s:.2f} s per optimizer step: {t.compute_s:.2f} s device compute "
                     f"({t.micro_s:.3f} s per micro-step at {a.gpu_flops / 1e12:.0f} TFLOP/s"
                     + (f", gradients down at {a.pcie / 1e9:.0f} GB/s" if t.host_s else "")
                     + (f"; {t.later_micro_s:.3f} s for each later one, the host accumulation"
                        if t.later_micro_s is not None and t.later_micro_s > t.micro_s else "") + ")"
                     + (f", host step {t.host_s:.2f} s at {a.host_rate / 1e9:.2f} Gparam/s beside training "
                        "(fp32 moments)" if t.host_s else "")
                     + (f" with every state read and written once on NVMe at {a.nvme_read / 1e9:.1f} / "
                        f"{a.nvme_write / 1e9:.1f} GB/s (read / write; {a.nvme_duplex / 1e9:.1f} GB/s together)"
                        if t.host_s and on_nvme else "")
                     + (f"; the host step and the copies leave {share} of the step exposed, the device idle "
                        "(the engine's recorded step replayed with these times)" if t.host_s else
                        "; no host step (the optimizer steps on the device)")
                     + (f" (target {EXPOSED_FRACTION:.0%})" if t.exposed_share > EXPOSED_FRACTION else "")
                     + f"; ~{t.tokens_per_s:,.0f} tokens/s per rank predicted")
    return notes


def _placement(c) -> str | None:
    """What the plan moves to host memory beyond the whole block inputs: a split of the inputs, or whole blocks."""
    section = c.raw.get("activation_checkpointing") or {}
    host = c.estimate.host
    if section.get("cpu_checkpointing_device_inputs"):
        return (f"the first {section['cpu_checkpointing_device_inputs']} block inputs stay on the device, the rest "
                f"wait in host memory (cpu_checkpointing_device_inputs: the host holds no more; "
                f"{host.get('checkpoint_inputs', 0) / 2**30:.1f} GiB each way per micro-step)")
    if section.get("cpu_layers"):
        return (f"the first {section['cpu_layers']} blocks keep their activations in host memory, not recomputed "
                f"(cpu_layers: the device holds no more; {host.get('layer_activations', 0) / 2**30:.1f} GiB each "
                f"way per micro-step, beside the compute)")
    return None
