"""`zero-offload estimate`: the table of every stage x offload choice, this machine's hardware, and DeepSpeed's
own estimator numbers beside ours where DeepSpeed imports."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from zero_offload.estimate.decoder_activations import DECODER_TYPES, decoder_shape
from zero_offload.estimate.memory import ModelShape, model_shape
from zero_offload.estimate.planner import Plan, fmt_bytes, parse_bytes
from zero_offload.estimate.sequence_plan import plan_sequence
from zero_offload.offload.host_limits import memlock_limit, usable_host_memory

__all__ = ["this_machine", "render", "deepspeed_estimates", "hf_config_shape", "parse_size_flag",
           "parse_count_flag", "parse_rate_flag", "plan_from_args", "run_estimate"]


def this_machine() -> dict:
    """{"gpus", "gpu_memory", "host_memory", "locked_memory"} of this machine: CUDA devices and their memory from
    torch (none: 0 bytes, the ranks compute on the host), total RAM from psutil or the cgroup's limit where lower,
    and with CUDA the locked-memory limit where it binds (`zero_offload.offload.host_limits`)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if gpus else 0
    return {"gpus": gpus, "gpu_memory": gpu_mem, "host_memory": usable_host_memory(),
            "locked_memory": memlock_limit() if gpus else None}


def hf_config_shape(path: str) -> ModelShape:
    """A parameter count from a Hugging Face ``config.json`` (a decoder: vocab, hidden, layers, intermediate), and
    for a Llama-family ``model_type`` its `DecoderShape` (activations).

    Raises:
        ValueError: the file is missing, not JSON, or lacks the sizes (the message names the file and key).
    """
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf-config {path}: cannot read a JSON config ({e})") from None
    def get(*names):
        for n in names:
            if isinstance(cfg.get(n), int):
                return cfg[n]
        raise ValueError(f"--hf-config {path}: no integer {' / '.join(names)} in the config")
    h = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    vocab = get("vocab_size")
    inter = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * h
    # transformers' Llama, Qwen2 and Mistral configs default to SiLU (a gated MLP: three matrices) when unset
    default_act = "silu" if cfg.get("model_type") in DECODER_TYPES else ""
    gated = 3 if cfg.get("hidden_act", cfg.get("activation_function", default_act)) in ("silu", "swiglu") else 2
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 1
    kv = cfg.get("num_key_value_heads") or heads
    attn = h * h * 2 + 2 * h * (h * kv // heads)
    units = [("embed", 0, (vocab * h,))]
    units += [(f"layers.{i}", 0, (attn, gated * h * inter, 2 * h)) for i in range(layers)]
    units.append(("norm", 0, (h,)))                   # the final norm
    # the head last, where the module order puts it; Llama, Qwen2 and Mistral configs default to an untied one
    if not cfg.get("tie_word_embeddings", cfg.get("model_type") not in DECODER_TYPES):
        units.append(("lm_head", 0, (vocab * h,)))
    # a Llama-family decoder's activations are counted too (with --seq-len): `estimate.decoder_activations`
    return ModelShape(tuple(units), None, Path(path).parent.name or Path(path).name, decoder=decoder_shape(cfg))


def deepspeed_estimates(shape: ModelShape, gpus: int) -> dict[str, tuple[int, int]] | None:
    """DeepSpeed's ``estimate_zero2/3_model_states_mem_needs`` for the same model: {row name: (device bytes
    per GPU, host bytes for the node)}; None where DeepSpeed does not import."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
    except Exception:   # not installed, or it fails to import on this machine
        return None
    n, largest = shape.n_params, shape.largest_unit
    out = {}
    cpu, gpu = z2(n, gpus, 1, cpu_offload=False)
    out["stage 2"] = (gpu, cpu)
    cpu, gpu = z2(n, gpus, 1, cpu_offload=True)
    out["stage 2 + offload opt"] = (gpu, cpu)
    cpu, gpu, _ = z3(n, largest, gpus, 1, cpu_offload=False, cpu_offload_params=False)
    out["stage 3"] = (gpu, cpu)
    cpu, gpu, _ = z3(n, largest, gpus, 1, cpu_offload=True, cpu_offload_params=False)
    out["stage 3 + offload opt"] = (gpu, cpu)
    cpu, gpu, _ = z3(n, largest, gpus, 1, cpu_offload=True, cpu_offload_params=True)
    out["stage 3 + offload opt+param"] = (gpu, cpu)
    return out


def render(result: Plan, shape: ModelShape, ds: dict | None) -> str:
    """The table: one row per candidate, per-rank device / host / NVMe bytes, host for all ranks, fits or
    not (``*`` marks the plan), and DeepSpeed's numbers where given."""
    accel = result.capacity["device"] is not None
    head = ["", "config", "device/rank" if accel else "-", "host/rank", f"host x{result.ranks}", "nvme/rank",
            "fits"]
    if ds is not None:
        head += ["DeepSpeed device", "DeepSpeed host"]
    lines = []
    for c in result.rows:
        if c.estimate is None:
            continue
        need = c.estimate.need()
        row = ["*" if c.name == result.name else "", c.name, fmt_bytes(need["device"]) if accel else "-",
               fmt_bytes(need["host"]), fmt_bytes(need["host"] * result.ranks),
               fmt_bytes(need["nvme"]) if need["nvme"] else "-",
               "yes" if c.fits else "no: " + ", ".join(f"{k} -{fmt_bytes(v)}" for k, v in c.short.items() if v)]
        if ds is not None:
            d = ds.get(c.name)
            row += [fmt_bytes(d[0]), fmt_bytes(d[1])] if d else ["", ""]
        lines.append(row)
    widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    names = [c.name for c in result.rows if c.estimate is None and c.error]
    skipped = [f"(skipped, not accepted by this build's config: {', '.join(names)})"] if names else []
    cap = result.capacity
    hw = (f"{result.ranks} rank(s)"
          + (f" x {fmt_bytes(cap['device'])} device" if accel else " on the host (no accelerator)")
          + f", host {fmt_bytes(cap['host'])}" + (f", NVMe {fmt_bytes(cap['nvme'])}" if cap["nvme"] else ""))
    out = [f"{shape.name}: {shape.n_params / 1e6:,.1f}M parameters; {hw}", fmt(head), *map(fmt, lines), *skipped]
    if ds is not None:
        out.append("DeepSpeed: estimate_zero2/3_model_states_mem_needs (model states only, host with its 1.5x "
                   "buffer factor, for all ranks)")
    chosen = result.chosen
    timed = chosen is not None and chosen.batch is not None and chosen.batch.timing is not None
    if timed and len([c for c in result.rows if c.estimate]) > 1:
        b = chosen.batch
        ckpt = {True: "on", False: "off", None: "as the model sets it"}[b.checkpointing]
        out.append(f"(the plan's row at its micro-batch {b.micro}, accumulation {b.gas}, activation checkpointing "
                   f"{ckpt}{', delayed update' if b.delayed else ''}{', super_offload' if b.speculative else ''}"
                   f"{f' ({b.fraction:.0%} speculated)' if b.speculative and b.fraction < 1 else ''}"
                   f"{f', ratio {b.ratio:g}' if b.ratio < 1 else ''}; every other row at its smallest setting)")
    if chosen is not None:
        out.append(f"plan: {result.name}")
        out += [f"  {k}: {v}" for k, v in result.reasons.items()]
        out += [f"  {kind}: {formula}" for kind, formula in chosen.estimate.formulas.items()]
        graph = chosen.batch.timing.graph if timed else None
        if graph is not None:
            out.append(f"predicted timeline of one step ({graph.step_s:.3f} s; one rank; letters: F forward, "
                       "B backward, d copy down, u copy up, a host accumulation, S host step; . idle):")
            out += [f"  {line}" for line in graph.lines()]
    else:
        out.append(result.message())
    return "\n".join(out)


def parse_count(value: str) -> int:
    """A parameter count from ``10e9``, ``10B``, ``350M``, ``124000000``.

    Raises:
        ValueError: not a positive count (the message names --params and the value).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"--params: cannot read {value!r} as a parameter count (examples: 10e9, 10B, 350M)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    count = int(float(m.group(1)) * scale)
    if count < 1:
        raise ValueError(f"--params must be >= 1, got {value!r}")
    return count


def parse_size_flag(value: str, flag: str) -> int:
    """Bytes from a size flag of `zero-offload estimate` (``--gpu-mem``, ``--host-mem``, ``--nvme``): ``80GB``
    (10^9), ``24GiB`` (2^30), ``512MiB``, or a bare number read as GB (``--gpu-mem 80`` is 80 GB: nobody
    means 80 bytes).

    Raises:
        ValueError: a negative or unparsable size (the message names ``flag`` and the value).
    """
    return parse_bytes(value, flag, bare_unit=10**9)


def parse_count_flag(value, flag: str) -> int | None:
    """A whole number >= 1 from a count flag (``--micro-batch``, ``--grad-accum``); None stays None.

    Raises:
        ValueError: not a whole number >= 1 (the message names ``flag`` and the value).
    """
    if value is None:
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")
    return n


def parse_rate_flag(value, flag: str, scale: float = 1.0) -> float | None:
    """A positive rate from a throughput flag (``--gpu-tflops 400``, ``--host-adam 1.9e9``, ``--pcie 25``) times
    ``scale`` (10^12 for TFLOP/s, 10^9 for GB/s); None stays None.

    Raises:
        ValueError: not a number > 0 (the message names ``flag`` and the value).
    """
    if value is None:
        return None
    try:
        x = float(str(value).strip())
    except ValueError:
        raise ValueError(f"{flag} must be a number > 0, got {value!r}") from None
    if not x > 0 or x == float("inf"):
        raise ValueError(f"{flag} must be a number > 0, got {value!r}")
    return x * scale


def run_estimate(ns) -> int:
    """The `zero-offload estimate` command (argparse namespace from `cli.py`): print the table and the plan, write
    the plan's config (``--write-config``) and its picture (``--plot``, `zero_offload.estimate.plot`).

    Returns:
        0, or 1 when nothing fits.

    Raises:
        ValueError: a bad flag (the message names it), as `plan_from_args` and `plot.check_plot_path` do.
    """
    given = sum(x is not None for x in (ns.model, ns.params, ns.hf_config))
    if given > 1:
        raise ValueError("give one of --model, --params, --hf-config")
    plot_path = getattr(ns, "plot", None)
    if plot_path is not None:
        from zero_offload.estimate.plot import check_plot_path
        plot_path = check_plot_path(plot_path)          # before the plan, which can take a while
    if getattr(ns, "largest", False) and getattr(ns, "longest", False):
        raise ValueError("give one of --largest (the largest model) and --longest (the longest sequence)")
    if getattr(ns, "largest", False):
        return _run_largest(ns, plot_path)
    if getattr(ns, "longest", False):
        return _run_longest(ns, plot_path)
    result, shape = plan_from_args(ns)
    ds = deepspeed_estimates(shape, result.ranks) if not ns.no_deepspeed else None
    print(render(result, shape, ds))
    _write_plot(result, plot_path, f"{shape.name}: plan {result.name}")
    if not result.fits:
        return 1
    if ns.write_config:
        Path(ns.write_config).write_text(json.dumps(result.config, indent=2) + "\n")
        print(f"wrote {ns.write_config}")
    return 0


def _write_plot(result: Plan, path: Path | None, title: str) -> None:
    """``--plot``: draw the plan the table printed (nothing when nothing fits, and say so)."""
    if path is None:
        return
    if not result.fits:
        print(f"{path} not written: nothing fits, no plan to draw")
        return
    from zero_offload.estimate.plot import plot_plan
    plot_plan(result, path, title)
    print(f"wrote {path}")


def plan_from_args(ns) -> tuple[Plan, ModelShape]:
    """The plan `zero-offload estimate` prints for its argparse namespace, and the model's shape: this machine's
    hardware where a flag does not give it.

    Raises:
        ValueError: a bad size, count or rate flag (the message names it); what `plan` raises.
    """
    shape = _shape_from_args(ns)
    machine, gpus, gpu_mem, host_mem, nvme = _machine_from_args(ns)
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if ns.seq_len is not None and ns.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {ns.seq_len}")
    ckpt = {"auto": None, "on": True, "off": False}[ns.activation_checkpointing]
    # a decoder at a sequence length: Ulysses' size, tiled compute and checkpointing chosen too (sequence_plan)
    result = plan_sequence(shape, gpus=gpus, gpu_memory=gpu_mem, host_memory=host_mem, nvme=nvme,
                           micro_batch=parse_count_flag(ns.micro_batch, "--micro-batch"), seq_len=ns.seq_len,
                           config=ns.config, gradient_accumulation=parse_count_flag(ns.grad_accum, "--grad-accum"),
                           activation_checkpointing=ckpt,
                           gpu_flops=parse_rate_flag(ns.gpu_tflops, "--gpu-tflops", 1e12),
                           host_adam=parse_rate_flag(ns.host_adam, "--host-adam"),
                           pcie=parse_rate_flag(ns.pcie, "--pcie", 1e9), calibration=getattr(ns, "calibration", None),
                           nvme_bandwidth=parse_rate_flag(getattr(ns, "nvme_gbps", None), "--nvme-gbps", 1e9),
                           locked_memory=machine["locked_memory"] if ns.host_mem is None else None,
                           allow_stale_step=getattr(ns, "allow_stale_step", False),
                           allow_bf16_masters=getattr(ns, "allow_bf16_masters", False),
                           allow_bf16_moments=getattr(ns, "allow_bf16_moments", False))
    return result, shape


def _shape_from_args(ns) -> ModelShape:
    if ns.hf_config is not None:
        return hf_config_shape(ns.hf_config)
    if ns.params is not None:
        return model_shape(parse_count(ns.params))
    return model_shape(ns.model or "tiny")


def _machine_from_args(ns) -> tuple:
    """(this machine, ranks, device bytes, host bytes, NVMe bytes or None): the flags, else this machine's."""
    machine = this_machine()
    gpus = ns.gpus if ns.gpus is not None else max(1, machine["gpus"])
    gpu_mem = parse_size_flag(ns.gpu_mem, "--gpu-mem") if ns.gpu_mem is not None else machine["gpu_memory"]
    host_mem = parse_size_flag(ns.host_mem, "--host-mem") if ns.host_mem is not None else machine["host_memory"]
    nvme = parse_size_flag(ns.nvme, "--nvme") if ns.nvme is not None else None
    return machine, gpus, gpu_mem, host_mem, nvme


def _search_kwargs(ns) -> dict:
    """The plan keywords `largest` and `longest` pass on: the allowances, the calibration and the given rates."""
    rates = {k: v for k, v in (("gpu_flops", parse_rate_flag(ns.gpu_tflops, "--gpu-tflops", 1e12)),
                               ("host_adam", parse_rate_flag(ns.host_adam, "--host-adam")),
                               ("pcie", parse_rate_flag(ns.pcie, "--pcie", 1e9)),
                               ("nvme_bandwidth", parse_rate_flag(getattr(ns, "nvme_gbps", None), "--nvme-gbps",
                                                                  1e9))) if v is not None}
    return dict(allow_stale_step=getattr(ns, "allow_stale_step", False),
                allow_bf16_masters=getattr(ns, "allow_bf16_masters", False),
                allow_bf16_moments=getattr(ns, "allow_bf16_moments", False),
                calibration=getattr(ns, "calibration", None), **rates)


def _run_longest(ns, plot_path: Path | None = None) -> int:
    """``zero-offload estimate --longest``: the longest sequence the model trains at on the machine described."""
    from zero_offload.estimate.longest import longest
    _, gpus, gpu_mem, host_mem, nvme = _machine_from_args(ns)
    found = longest(_shape_from_args(ns), gpus, gpu_mem, host_mem, nvme, config=ns.config, **_search_kwargs(ns))
    if found is None:
        print("not even 1,024 tokens fit this machine")
        return 1
    print("\n".join(found.lines()))
    _write_plot(found.plan, plot_path, f"longest: {found.seq_len:,} tokens, plan {found.plan.name}")
    if ns.write_config:
        Path(ns.write_config).write_text(json.dumps(found.plan.config, indent=2) + "\n")
        print(f"wrote {ns.write_config}")
    return 0


def _run_largest(ns, plot_path: Path | None = None) -> int:
    """``zero-offload estimate --largest``: the largest GPT-2-shaped model that trains on the machine described."""
    from zero_offload.estimate.largest import largest
    _, gpus, gpu_mem, host_mem, nvme = _machine_from_args(ns)
    found = largest(gpus, gpu_mem, host_mem, nvme, seq_len=ns.seq_len or 1024, config=ns.config,
                    **_search_kwargs(ns))
    if found is None:
        print("no GPT-2-shaped model fits this machine")
        return 1
    print("\n".join(found.lines()))
    _write_plot(found.plan, plot_path, f"largest: {found.params / 1e9:.1f}B parameters, plan {found.plan.name}")
    return 0
