"""The planner: the fastest ZeRO config that fits the hardware with headroom, with the reason for each choice.

On an accelerator, throughput decides: every config that fits is searched for its micro-batch, accumulation,
checkpointing and delayed update, and the fastest by the step model wins (only an equal prediction, to within
`THROUGHPUT_TOLERANCE`'s rounding, goes to the earlier in the order below: a margin would let more memory, which
only adds configs that fit, predict a slower plan). The order of preference, used for ties and without an
accelerator: the lowest stage
(0, 1, 2: less communication and no gathering), then the optimizer offloaded to the host (stage 2,
ZeRO-Offload), then stage 3, then stage 3 with the optimizer and then the parameters offloaded, then NVMe
(where built), then smaller buckets and live-parameter limits. Without an accelerator the same order holds:
the compute device is the host, so offloading saves no memory there and only adds copies
(`benchmarks/bench_planner.py` measured stage 0 ahead of stage 2 + offload_optimizer on the CPU).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass

from zero_offload.config import Config, ConfigError
from zero_offload.config.io import raw_config
from zero_offload.estimate.batching import BatchChoice, Knobs, choose_batch
from zero_offload.estimate.candidates import Candidate, candidates
from zero_offload.estimate.throughput import calibrated
from zero_offload.estimate.memory import ModelShape, default_plan_config, estimate_memory, model_shape
from zero_offload.estimate.decoder_activations import SequenceTiles
from zero_offload.offload.host_limits import RAISE_MEMLOCK

__all__ = ["Candidate", "Plan", "plan", "candidates", "parse_bytes", "fmt_bytes", "HEADROOM"]

# Fraction of each memory kept free: allocator fragmentation, the framework's own buffers, other processes.
HEADROOM = 0.10
# Pageable host buffers' copy rate against page-locked ones: assumed, not measured here (each copy stages through
# a driver buffer and blocks the host).
PAGEABLE_PCIE_SHARE = 0.5


def parse_bytes(value, what: str = "memory size", bare_unit: int = 1) -> int:
    """Bytes from an int or a string like ``80GB`` (10^9), ``24GiB`` (2^30), ``512M``, ``1.5T``, ``512B``.

    A string with no unit (``"80"``) is that many ``bare_unit`` bytes: 1 by default (this function's
    behaviour for the Python API), ``10**9`` on the command line (`zero_offload.estimate.table`), where
    ``--gpu-mem 80`` means 80 GB and never 80 bytes. An int or float is always bytes.

    Raises:
        ValueError: a negative or unparsable size (the message names ``what`` and the value).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        nbytes = int(value)
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*", str(value), re.IGNORECASE)
        if not m:
            raise ValueError(f"{what}: cannot read {value!r} as a size (examples: 80GB, 24GiB, 512MiB, 1.5TB)")
        base = 1024 if m.group(3) else 1000
        unit = bare_unit if not (m.group(2) or m.group(3) or m.group(4)) else 1
        nbytes = int(float(m.group(1)) * base ** " kmgtp".index(m.group(2).lower() or " ") * unit)
    if nbytes < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return nbytes


def fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# Among the configs that fit, the first in order of preference whose predicted throughput equals the best one's to
# within this share (float rounding; a tie keeps the more conservative config: lower stage, fp32 moments).
THROUGHPUT_TOLERANCE = 1e-9
# What changes what is trained, each with the allowance that lets the plan choose it (the config may ask itself).
PRECISION_ALLOWANCES = {
    "bf16_master_weights_and_grads": ("bf16 master weights", "--allow-bf16-masters",
                                      "plan(allow_bf16_masters=True)"),
    "bf16_optimizer_states": ("bf16 moments", "--allow-bf16-moments", "plan(allow_bf16_moments=True)"),
}


def _fastest(fitting: list[Candidate], searched: dict[str, BatchChoice]) -> Candidate | None:
    """The plan's row: the best predicted tokens/s among the rows that fit, the earlier in the order of preference
    among equal ones (`THROUGHPUT_TOLERANCE`). Without a predicted step (no accelerator): the first that fits."""
    timed = [c for c in fitting if c.name in searched and searched[c.name].timing is not None]
    if not timed:
        return fitting[0] if fitting else None
    best = max(searched[c.name].timing.tokens_per_s for c in timed)
    return next(c for c in timed if searched[c.name].timing.tokens_per_s >= best * (1 - THROUGHPUT_TOLERANCE))


@dataclass
class Plan:
    """The planner's answer.

    Attributes:
        config: the chosen DeepSpeed-style config (a dict `initialize` accepts), or None when nothing fits.
        name: the chosen row's name; reasons: {config key: why}.
        rows: every candidate with its estimate and whether it fits (the `zero-offload estimate` table).
        missing: when nothing fits, {side: bytes short} for the candidate that came closest.
        ranks: ranks sharing the host's memory.
        capacity: {side: bytes} the plan was made for (device None: no accelerator).
        batch: the chosen micro-batch, accumulation, checkpointing and delayed update, with the predicted step
            (``batch.timing``, None without an accelerator or a sequence length).
    """
    config: dict | None
    name: str | None
    reasons: dict[str, str]
    rows: list[Candidate]
    missing: dict[str, int]
    ranks: int
    capacity: dict[str, int | None]
    batch: BatchChoice | None = None

    @property
    def fits(self) -> bool:
        return self.config is not None

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.rows if c.name == self.name), None)

    def message(self) -> str:
        """One paragraph: the choice and why, or what is missing and where."""
        if self.fits:
            why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
            return f"plan: {self.name} ({why})"
        where = ", ".join(f"{fmt_bytes(v)} of {side} memory" + (" per rank" if side == "device" else "")
                          for side, v in self.missing.items() if v > 0)
        rows = [c for c in self.rows if c.estimate is not None]
        best = min(rows, key=lambda c: sum(c.short.values()))
        text = f"nothing fits: the closest config ({best.name}) is missing {where}"
        frugal = min(rows, key=lambda c: (c.estimate.need()["device"], sum(c.short.values())))
        if frugal is not best:
            more = ", ".join(f"{fmt_bytes(v)} of {k} memory" for k, v in frugal.short.items() if v)
            text += f"; the one with the least on the device ({frugal.name}) is missing {more}"
        flags = sorted({flag for c in self.rows if c.error and "not chosen unless allowed" in c.error
                        for key, (_, flag, _) in PRECISION_ALLOWANCES.items() if c.bf16.get(key)})
        if flags:
            text += f"; the rows with bf16 optimizer states were not tried: they need {' and '.join(flags)}"
        return f"{text} (capacity with {HEADROOM:.0%} headroom: {self._cap_text()})"

    def _cap_text(self) -> str:
        parts = []
        for side, cap in self.capacity.items():
            if cap is not None:
                parts.append(f"{side} {fmt_bytes(int(cap * (1 - HEADROOM)))}")
        return ", ".join(parts)


# The swap directory a plan with NVMe names where the base config gives none (DeepSpeed's documentation's example).
NVME_PATH_UNSET = "/local_nvme"
# Elements per NVMe sub-group the planner gives a config that does not set one: 3 pool buffers of 1.2 GB.
NVME_SUB_GROUP = 100_000_000


def _zero_section(base: dict, zero: dict) -> dict:
    out = {k: v for k, v in base.get("zero_optimization", {}).items()
           if k not in ("stage", "offload_optimizer", "offload_param")}
    out.update(copy.deepcopy(zero))
    for key in ("offload_optimizer", "offload_param"):
        # The base config's offload settings (pin_memory, nvme_path) stay with a candidate that offloads; each
        # section its own dict (a row may give both the same one: the batch choice's keys go to the optimizer's)
        given = base.get("zero_optimization", {}).get(key)
        if key in out:
            out[key] = {**(given if isinstance(given, dict) else {}), **out[key]}
    for key in ("offload_optimizer", "offload_param"):     # no mount given: a placeholder, named in the reasons
        if out.get(key, {}).get("device") == "nvme":
            out[key].setdefault("nvme_path", NVME_PATH_UNSET)
    if out.get("offload_optimizer", {}).get("device") == "nvme":
        # DeepSpeed's default sub-group (1e9 elements) makes the pool 12 GB a buffer; a smaller one streams as fast
        out.setdefault("sub_group_size", NVME_SUB_GROUP)
    if out["stage"] == 2:
        out.setdefault("contiguous_gradients", True)
        out.setdefault("overlap_comm", True)
    return out


def _knobs(base: dict, user_config: bool, gpus: int, accelerator: bool, shape: ModelShape, micro_batch,
           gradient_accumulation, activation_checkpointing, allow_stale_step: bool = False) -> Knobs:
    """What the plan chooses and what is fixed: a value given as an argument or in the user's config is kept;
    without an accelerator nothing is chosen (the host computes: no step model, the config's batch)."""
    # A base config without batch keys leaves them to the plan (without an accelerator: 1 and 1)
    batched = any(k in base for k in ("train_micro_batch_size_per_gpu", "train_batch_size"))
    parsed = Config.load(base)
    sizes = parsed.batch_sizes(gpus // parsed.sequence_parallel_size) if batched else None   # replicas under Ulysses
    given = lambda *keys: user_config and any(k in base for k in keys)          # noqa: E731
    fixed = (lambda *keys: given(*keys) or not accelerator) if sizes else (lambda *keys: False)   # noqa: E731
    unset = None if accelerator else 1
    micro = micro_batch if micro_batch is not None else (
        sizes.micro_batch_per_gpu if fixed("train_micro_batch_size_per_gpu", "train_batch_size") else unset)
    gas = gradient_accumulation if gradient_accumulation is not None else (
        sizes.gradient_accumulation_steps if fixed("gradient_accumulation_steps", "train_batch_size") else unset)
    offload = base.get("zero_optimization", {}).get("offload_optimizer", {})
    dpu, spec, ratio = ((offload.get("delayed_param_update"), offload.get("super_offload"), offload.get("ratio"))
                        if isinstance(offload, dict) else (None, None, None))
    if str((base.get("optimizer") or {}).get("type", "")).lower() == "muon":
        # Muon steps after backward on the training thread, each matrix whole (`zero_offload.config.optim.check_muon`)
        dpu, spec, ratio = dpu or False, spec or False, 1.0 if ratio is None else ratio
    return Knobs(micro, gas, activation_checkpointing, dpu if (dpu is not None or accelerator) else False,
                 choose_checkpointing=accelerator and shape.gpt is not None,
                 super_offload=spec if (spec is not None or accelerator) else False,
                 ratio=ratio if (ratio is not None or accelerator) else 1.0, allow_stale_step=allow_stale_step,
                 super_offload_fraction=offload.get("super_offload_fraction") if isinstance(offload, dict) else None)


def _positive_int(value, name: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _precision_reason(chosen: Candidate, base: dict, rows: list[Candidate]) -> str:
    """What the plan's host states are kept in, and who asked for anything below fp32."""
    lowered = [k for k in PRECISION_ALLOWANCES if chosen.bf16.get(k) or (base.get("bf16") or {}).get(k)]
    if lowered:
        return "; ".join(f"{PRECISION_ALLOWANCES[k][0]}: " + ("the config asks for them" if (base.get("bf16") or {})
                                                             .get(k) else f"allowed ({PRECISION_ALLOWANCES[k][1]})")
                         for k in lowered)
    held_back = sorted({PRECISION_ALLOWANCES[k][1] for c in rows if c.error and "not chosen unless allowed" in c.error
                        for k in PRECISION_ALLOWANCES if c.bf16.get(k)})
    return "fp32 master weights and moments (exact)" + (f"; rows with bf16 states need {', '.join(held_back)}"
                                                        if held_back else "")


def plan(model, gpus: int = 1, gpu_memory=None, host_memory=None, nvme=None, micro_batch: int | None = None,
         seq_len: int | None = None, config: "dict | str | Config | None" = None,
         headroom: float = HEADROOM, *, gradient_accumulation: int | None = None,
         activation_checkpointing: bool | None = None, gpu_flops: float | None = None,
         host_adam: float | None = None, pcie: float | None = None, nvme_bandwidth: float | None = None,
         calibration=None,
         allow_stale_step: bool = False, locked_memory: int | None = None, timed: bool = True,
         allow_bf16_masters: bool = False, allow_bf16_moments: bool = False,
         tiles: SequenceTiles | None = None) -> Plan:
    """The fastest config for ``model`` on ``gpus`` ranks of one machine that fits with ``headroom`` free.

    The stage and offload follow the order of `candidates`; for the first config that fits, the plan also
    chooses the micro-batch, gradient accumulation, activation checkpointing and the delayed parameter update
    (`zero_offload.estimate.batching`, by the step model of `zero_offload.estimate.throughput`), each unless
    given here or in ``config``.

    Args:
        model: an ``nn.Module``, a preset name, a `GPTConfig` or a parameter count (see `estimate_memory`).
        gpus: data-parallel ranks on this machine (>= 1); they share its host memory.
        gpu_memory: bytes (or a string like ``80GB``) per accelerator; None or 0: no accelerator, the ranks
            compute on the host (then nothing but stage and offload is chosen).
        host_memory: host bytes for all ranks together (required).
        nvme: NVMe bytes available (None: no NVMe).
        micro_batch: sequences per micro-batch (default: the config's when it sets one, else chosen).
        seq_len: tokens per sequence (default: a GPT's context; a transformers decoder needs it for its
            activations and the predicted step, see `estimate_memory`).
        config: the base config whose precision and optimizer the plan keeps (default: the seed's, bf16); its
            batch keys and ``delayed_param_update``, when set, are kept too.
        gradient_accumulation: micro-steps per optimizer step (default: the config's when set, else chosen).
        activation_checkpointing: fix it (default: chosen for a GPT shape on an accelerator, else the model's;
            a transformers decoder's ``is_activation_checkpointing``).
        gpu_flops, host_adam, pcie: the step model's figures: sustained FLOP/s per accelerator, host Adam
            parameters/s (fp32 moments), host <-> device bytes/s; each overrides ``calibration``'s.
        nvme_bandwidth: bytes/s of one rank's swap-file reads, of its writes, and of both together (the step
            model's ``nvme_read``, ``nvme_write`` and ``nvme_duplex``), overriding ``calibration``'s.
        allow_stale_step: the plan may turn the delayed parameter update on (default: never unless ``config``
            sets it: it trains each step on parameters one step old; the reasons say what it would gain).
        allow_bf16_masters: the plan may choose bf16 master weights (DeepSpeed's ``bf16_master_weights_and_grads``:
            8 instead of 10 host bytes per parameter; updates below half a bf16 ulp are lost), where ``config`` does
            not ask for them itself (default: never: they change what is trained).
        allow_bf16_moments: the plan may keep Adam's moments in bf16 on the host (DeepSpeed's
            ``bf16_optimizer_states``: 10 instead of 14 host bytes per parameter; each moment rounded to bf16 at
            every step), where ``config`` does not ask for them itself (default: never: they change what is
            trained). A row with bf16 masters and moments needs both allowances.
        tiles: the sequence-tiled compute a decoder runs with (`SequenceTiles`): its activations are counted so
            (`estimate_memory`).
        locked_memory: bytes of host memory each rank may page-lock (``RLIMIT_MEMLOCK`` where it binds:
            `zero_offload.offload.host_limits.memlock_limit`); None: no limit. Where the plan's page-locked
            buffers exceed it they stay pageable (`zero_offload.offload.pinned.host_empty`): the step is predicted
            with copies at `PAGEABLE_PCIE_SHARE` of ``pcie``, and ``reasons["pin_memory"]`` says so.
        timed: False: only whether and where the model fits, each row at its smallest setting (no step model,
            nothing chosen by speed: the first row that fits, in `candidates`' order).
        calibration: a file written by ``zero-offload calibrate`` (`throughput.calibrated`: default
            ``$ZERO_OFFLOAD_CALIBRATION`` or ``~/.cache/zero_offload/calibration.json`` when it exists, else the
            built-in `Assumptions`); ``reasons["constants"]`` says which figures were used and where from.

    Returns:
        A `Plan`: ``plan.config`` is the chosen DeepSpeed-style dict, ``plan.reasons`` says why, ``plan.batch``
        the chosen setting and its predicted step; when nothing fits ``plan.config`` is None and
        ``plan.missing`` / ``plan.message()`` say how much is missing where.

    Raises:
        ValueError: ``gpus``, ``micro_batch`` or ``gradient_accumulation`` < 1, a throughput figure <= 0, a
            negative memory size, no ``host_memory``, or a bad model (see `model_shape`); ConfigError: a bad
            base config.
    """
    _positive_int(gpus, "gpus")
    _positive_int(micro_batch, "micro_batch")
    _positive_int(gradient_accumulation, "gradient_accumulation")
    measured = calibrated(calibration)
    given = {k: v for k, v in (("gpu_flops", gpu_flops), ("host_adam", host_adam), ("pcie", pcie),
                               ("nvme_read", nvme_bandwidth), ("nvme_write", nvme_bandwidth),
                               ("nvme_duplex", nvme_bandwidth)) if v is not None}
    figures = dataclasses.replace(measured, **given,
                                  source=measured.source + (f"; given: {', '.join(given)}" if given else ""))
    gpu_bytes = parse_bytes(gpu_memory, "gpu_memory") if gpu_memory is not None else 0
    if host_memory is None:
        raise ValueError("host_memory is required (bytes, or a size such as '128GB')")
    host_bytes = parse_bytes(host_memory, "host_memory")
    nvme_bytes = parse_bytes(nvme, "nvme") if nvme is not None else 0
    accelerator = gpu_bytes > 0
    if isinstance(config, (str, os.PathLike)):
        config = raw_config(config)               # the keys as the file sets them: the rest is the plan's
    if isinstance(config, dict):
        Config.load(config)                       # a bad base config fails here, naming the key
        base = copy.deepcopy(config)
    else:
        base = Config.load(config).to_dict() if config is not None else default_plan_config()
        base = {k: v for k, v in base.items() if v is not None}
    muon = str((base.get("optimizer") or {}).get("type", "")).lower() == "muon"
    shape = model if isinstance(model, ModelShape) else model_shape(model, muon=muon)
    if activation_checkpointing is None and shape.decoder is not None:
        # A transformers decoder's own setting, so that the step model times the recompute it will do
        activation_checkpointing = shape.decoder.activation_checkpointing
    knobs = dataclasses.replace(_knobs(base, config is not None, gpus, accelerator, shape, micro_batch,
                                       gradient_accumulation, activation_checkpointing, allow_stale_step), tiles=tiles)
    seq = seq_len or (shape.gpt.block_size if shape.gpt is not None else None)
    keep = 1 - headroom

    def measure(raw: dict, micro: int, ckpt: bool | None):
        est = estimate_memory(shape, raw, gpus, micro_batch=micro, seq_len=seq_len, activation_checkpointing=ckpt,
                              accelerator=accelerator, tiles=tiles)
        need = est.need()
        return est, {"device": max(0, int(need["device"] - gpu_bytes * keep)) if accelerator else 0,
                     "host": max(0, int(need["host"] * gpus - host_bytes * keep)),
                     "nvme": max(0, int(need["nvme"] * gpus - nvme_bytes * keep))}

    rows = candidates()
    searched: dict[str, BatchChoice] = {}
    raws: dict[str, dict] = {}
    for cand in rows:
        raw = raws[cand.name] = {**base, "zero_optimization": _zero_section(base, cand.zero)}
        if cand.bf16:
            if not base.get("bf16", {}).get("enabled"):
                cand.error = "bf16 optimizer states need bf16 training"
                continue
            allowed = {"bf16_master_weights_and_grads": allow_bf16_masters,
                       "bf16_optimizer_states": allow_bf16_moments}
            refused = [k for k in PRECISION_ALLOWANCES if cand.bf16.get(k) and not (allowed[k] or base["bf16"].get(k))]
            if refused:
                what, flag, call = PRECISION_ALLOWANCES[refused[0]]
                cand.error = f"{what} change what is trained: not chosen unless allowed ({flag}, {call})"
                continue
            raw["bf16"] = {**base["bf16"], **cand.bf16}
        try:
            Config.load(raw)
            batch = choose_batch(shape, raw, gpus, None, knobs, figures, measure)     # its smallest setting
            if batch.fits and accelerator and seq and timed:
                searched[cand.name] = choose_batch(shape, raw, gpus, seq, knobs, figures, measure)
        except ConfigError as e:
            cand.error = str(e)
            continue
        cand.batch, cand.estimate, cand.short, cand.fits = batch, batch.estimate, batch.short, batch.fits
    chosen = _fastest([c for c in rows if c.fits], searched)
    locked_note = None
    if chosen is not None and locked_memory is not None and chosen.estimate.pinned > locked_memory:
        # Past the limit page-locking fails and the buffers stay pageable: the copies are slower.
        figures = dataclasses.replace(figures, pcie=figures.pcie * PAGEABLE_PCIE_SHARE)
        if chosen.name in searched:
            searched[chosen.name] = choose_batch(shape, raws[chosen.name], gpus, seq, knobs, figures, measure)
        locked_note = (f"{fmt_bytes(chosen.estimate.pinned)} of page-locked buffers per rank, over the "
                       f"locked-memory limit of {fmt_bytes(locked_memory)} (RLIMIT_MEMLOCK): they stay pageable, "
                       f"and the step is predicted with copies at {PAGEABLE_PCIE_SHARE:.0%} of the pinned rate; "
                       f"{RAISE_MEMLOCK}")
    if chosen is not None and chosen.name in searched:
        # The plan's row shows its chosen setting; every other row its smallest one.
        b = chosen.batch = searched[chosen.name]
        chosen.estimate, chosen.short, chosen.fits = b.estimate, b.short, b.fits
    capacity = {"device": gpu_bytes if accelerator else None, "host": host_bytes, "nvme": nvme_bytes or None}
    if chosen is None:
        scored = [c for c in rows if c.estimate is not None]
        best = min(scored, key=lambda c: sum(c.short.values()))
        return Plan(None, None, {}, rows, {k: v for k, v in best.short.items() if v}, gpus, capacity)
    reasons = {"zero_optimization": chosen.reason, "precision": _precision_reason(chosen, base, rows)}
    earlier = rows[:rows.index(chosen)]
    passed = [c.name for c in earlier if c.estimate is not None and not c.fits]
    slower = [f"{c.name} (~{searched[c.name].timing.tokens_per_s:,.0f} tokens/s)" for c in earlier
              if c.fits and c.name in searched and searched[c.name].timing is not None]
    rejected = ([f"does not fit: {', '.join(passed)}"] if passed else []) + \
        ([f"fits but slower: {', '.join(slower)}"] if slower else [])
    if rejected:
        reasons["rejected"] = "; ".join(rejected)
    need = chosen.estimate.need()
    reasons["memory"] = (f"per rank {fmt_bytes(need['device'])} device, {fmt_bytes(need['host'])} host"
                         + (f", {fmt_bytes(need['nvme'])} NVMe" if need["nvme"] else ""))
    reasons.update(chosen.batch.notes)
    if locked_note is not None:
        reasons["pin_memory"] = locked_note
    if unset := [k for k, v in chosen.batch.raw["zero_optimization"].items() if k.startswith("offload_")
                 and v.get("nvme_path") == NVME_PATH_UNSET]:
        reasons["nvme_path"] = f"{NVME_PATH_UNSET} is a placeholder: set {' and '.join(unset)}.nvme_path to a " \
                               "directory on the NVMe drive (the base config gave none)"
    if chosen.batch.timing is not None:
        reasons["constants"] = (f"{figures.gpu_flops / 1e12:.0f} TFLOP/s sustained, host Adam "
                                f"{figures.host_adam / 1e9:.2f} Gparam/s (x{figures.host_load_share:.2f} beside "
                                f"training), {figures.pcie / 1e9:.0f} GB/s each way "
                                f"({figures.source})")
    return Plan(chosen.batch.raw, chosen.name, reasons, rows, {}, gpus, capacity, chosen.batch)
