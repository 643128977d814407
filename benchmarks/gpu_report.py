"""The markdown tables of `gpu_validate.py`'s report (``gpu_validate.md``)."""
from __future__ import annotations

import json

__all__ = ["markdown"]

SECTIONS = ("calibrate", "cuda_tests", "sanitizer", "gpt2", "gpt2_xl", "gpt2_compiled", "gpt2_10b", "gpt2_10b_dpu",
            "largest", "largest_planned", "two_gpus", "llama_trainer")


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _build_note(build: dict) -> str:
    if not build["built"]:
        return ""
    if build["still_missing"]:
        return f" (this run's build failed, exit {build['returncode']}: {', '.join(build['still_missing'])} missing)"
    return " (built by this run)"


RUN_HEAD = ("| run | native | tokens/s | vs plain | MFU | peak dev GiB | reserved GiB | estimate / peak "
            "| device fwd s | device bwd s | device opt s | exposed host step s | host syncs / step | copy overlap |")


def _comparison(title: str, section: dict) -> list[str]:
    """A model's runs side by side (`gpu_validate._compare`), and the speculated step's figures."""
    if not section.get("runs"):
        return []
    runs = section["runs"]
    lines = ["", f"## {title}, bf16, seq {section['seq_len']}, micro-batch {section['micro_batch']}", "", RUN_HEAD,
             "| --- |" + " --- |" * 12]
    lines += [_run_row(key, r) for key, r in runs.items()]
    lines += ["", COPY_HEAD, "| --- |" + " --- |" * 7] + [_copy_row(k, r) for k, r in runs.items()]
    spec = {k: r for k, r in runs.items() if "host_step_kept" in (r.get("timings") or {})}
    if spec:
        lines += ["", "| super_offload run | host step s | of it during backward s | kept | second bank GiB (host) |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {_num(r['timings'].get('host_step_s'), '.4f')} | "
                  f"{_num(r['timings'].get('host_step_hidden_s'), '.4f')} | {_num(r['timings']['host_step_kept'])} | "
                  f"{_gib(r.get('speculative_state_bytes', 0))} |" for k, r in spec.items()]
    return lines


def _run_row(key: str, r: dict) -> str:
    t = r.get("timings") or {}
    dev = "device_" if "device_step_s" in t else ""
    return (f"| {key} | {r.get('native_kernel', '-')} | {r['tokens_per_s']:.0f} | "
            f"{_num(r.get('tokens_per_s_vs_plain'))} | {_num(r.get('mfu'), '.3f')} | {_gib(r['peak_device_bytes'])} | "
            f"{_gib(r.get('peak_reserved_bytes', 0))} | {_num(r.get('estimate_over_peak'))} | "
            f"{_num(t.get(dev + 'forward_s'), '.4f')} | "
            f"{_num(t.get(dev + 'backward_s'), '.4f')} | {_num(t.get(dev + 'optimizer_s'), '.4f')} | "
            f"{_num(t.get(dev + 'exposed_host_step_s'), '.4f')} | {_num(r.get('host_syncs_per_step'), '.1f')} | "
            f"{_num(r.get('copy_overlap'))} |")


COPY_HEAD = ("| run | host syncs / step (s) | event syncs / step (s) | device idle | H2D s, GB/s, overlap "
             "| D2H s, GB/s, overlap | host step s (threads) | cores (torch threads) |")


def _copy(c: dict | None) -> str:
    if not c or not c.get("count"):
        return "-"
    rate = c.get("bytes_per_s")
    return f"{c['s']:.3f}, {_num(rate / 1e9 if rate else None, '.1f')}, {_num(c.get('overlap'))}"


def _copy_row(key: str, r: dict) -> str:
    """Where a step's time goes beyond compute: syncs, idle device, copies each way, the host step."""
    t, c, h = r.get("timings") or {}, r.get("copies") or {}, r.get("host_threads") or {}
    return (f"| {key} | {_num(r.get('host_syncs_per_step'), '.0f')} ({_num(r.get('host_sync_s_per_step'), '.3f')}) | "
            f"{_num(r.get('event_syncs_per_step'), '.0f')} ({_num(r.get('event_sync_s_per_step'), '.3f')}) | "
            f"{_num(r.get('device_idle_share'))} | {_copy(c.get('h2d'))} | {_copy(c.get('d2h'))} | "
            f"{_num(t.get('host_step_s'), '.3f')} ({_num(t.get('host_step_threads'), '.0f')}) | "
            f"{h.get('available_cores', '-')} ({h.get('torch_threads', '-')}) |")


def _ten_b(name: str, big: dict) -> list[str]:
    p, dpu = big["predicted"], big["config"]["zero_optimization"]["offload_optimizer"]["delayed_param_update"]
    return ["", f"## {name}: 10B GPT-2, pinned config (micro-batch {big['micro_batch']}, accumulation "
                f"{big['gradient_accumulation']}, DPU {dpu})", "",
            f"{big['params'] / 1e9:.2f} B params; {big['tflops']:.1f} TFLOP/s; MFU {big['mfu']:.3f}; "
            f"{big['step_s']:.2f} s per step (the step model predicts {_num(p.get('step_s'))} s, exposed share "
            f"{_num(p.get('exposed_share'))}; planner on 80 GB: fits {p.get('fits')}; {p.get('constants') or ''}); "
            f"peak device "
            f"{_gib(big['peak_device_bytes'])} GiB (estimate / peak {_num(big.get('estimate_over_peak'))}); peak "
            f"host RSS {_gib(big['peak_rss_bytes'])} GiB; host state {big['host_bytes_per_param']:.2f} B/param; "
            f"losses {', '.join(f'{x:.3f}' for x in big['losses_all_steps'])}", "",
            RUN_HEAD, "| --- |" + " --- |" * 12, _run_row(name, big), "",
            COPY_HEAD, "| --- |" + " --- |" * 7, _copy_row(name, big), *_timeline(p, big)]


def _timeline(p: dict, big: dict) -> list[str]:
    """The step model's replayed timeline (`zero_offload.estimate.step_graph`) beside the measured step."""
    if not p.get("timeline"):
        return []
    t, c, busy = big.get("timings") or {}, big.get("copies") or {}, p.get("busy") or {}
    host = next((v for k, v in busy.items() if k in ("training thread", "host step thread")), None)
    device = (t["device_forward_s"] + t["device_backward_s"]) if "device_forward_s" in t else None
    rows = [("step s", p.get("step_s"), big.get("step_s")), ("device compute s", p.get("compute_s"), device),
            ("device idle share", p.get("idle_share"), big.get("device_idle_share")),
            ("copies down s", busy.get("copies down"), (c.get("d2h") or {}).get("s")),
            ("copies up s", busy.get("copies up"), (c.get("h2d") or {}).get("s")),
            ("host step s", host, t.get("host_step_s"))]
    return ["", "Predicted (the engine's recorded step replayed with the plan's times) against measured:", "",
            "| per step | predicted | measured |", "| --- | --- | --- |",
            *[f"| {k} | {_num(a, '.3f')} | {_num(b, '.3f')} |" for k, a, b in rows], "", "```",
            *p["timeline"], "```"]


def markdown(report: dict) -> str:
    """The report as markdown: sections, then each section's table."""
    lines = [f"# gpu_validate ({report['device_name']}, torch {report['torch']})", "",
             f"Command: `{report['command']}`; total {report['wall_s']} s.", "",
             "native_available(): " + ", ".join(f"{k} {v}" for k, v in report["native"]["available"].items())
             + _build_note(report["native"]["build"]), "",
             "Timings are device time from CUDA events on a GPU (wall-clock on the CPU); host syncs and copy overlap "
             "come from a torch.profiler trace of one step.", "",
             "| section | ok | wall s |", "| --- | --- | --- |"]
    sections = report["sections"]
    for name in SECTIONS:
        if name in sections:
            s = sections[name]
            lines.append(f"| {name} | {s.get('ok')} | {s.get('wall_s')} |" + (f" {s['skipped']} |"
                                                                              if s.get("skipped") else ""))
    for name, title in (("gpt2", "(c) gpt2"), ("gpt2_xl", "gpt2 XL, activation checkpointing")):
        lines += _comparison(title, sections.get(name, {}))
    compiled = sections.get("gpt2_compiled", {})
    if compiled.get("runs"):
        lines += ["", f"## gpt2, compiled ({compiled['backend']}), micro-batch {compiled['micro_batch']}", "",
                  "| run | tokens/s | vs plain eager AdamW | step s |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_vs_plain']:.2f} | {r['step_s']:.4f} |"
                  for k, r in compiled["runs"].items()]
    cal = sections.get("calibrate", {})
    if cal.get("constants"):
        lines += ["", "## calibration (zero-offload calibrate)", "", "```", json.dumps(cal["constants"], indent=1),
                  json.dumps(cal.get("measured"), indent=1), "```"]
    largest = sections.get("largest", {})
    if largest.get("attempts"):
        tried = ", ".join(f"{a['layers']} {'ok' if a['ok'] else 'failed'} ({a.get('wall_s', 0):.0f} s)"
                          for a in largest["attempts"])
        lines += ["", f"## (d) largest GPT, stage 3 + both offloads (tries: {tried})"]
        b = largest.get("largest")
        if b:
            lines += ["", f"{b['layers']} layers, {b['params'] / 1e9:.2f} B params, peak device "
                          f"{_gib(b['peak_device_bytes'])} GiB (estimate / peak {_num(b.get('estimate_over_peak'))}), "
                          f"peak host RSS {_gib(b['peak_rss_bytes'])} GiB, {b['step_s']:.1f} s per step, host syncs "
                          f"per step {_num(b.get('host_syncs_per_step'), '.1f')}, copy overlap "
                          f"{_num(b.get('copy_overlap'))}, native kernel {b.get('native_kernel')}"]
    planned = sections.get("largest_planned", {})
    if planned.get("ok"):
        m, e = planned["measured"], planned["estimate"]
        lines += ["", f"## (d') largest model the estimate names ({planned['plan']}, bf16 masters allowed)", "",
                  f"{planned['params'] / 1e9:.2f} B params ({planned['shape']}): MFU {_num(planned.get('mfu'))} "
                  f"(predicted {_num(planned.get('predicted_mfu'))}), {m['step_s']:.1f} s per step (predicted "
                  f"{_num(e.get('predicted_step_s'), '.1f')}), peak device {_gib(m['peak_device_bytes'])} GiB "
                  f"(/ estimate {_num(planned.get('device_over_estimate'))}), peak host RSS "
                  f"{_gib(m['peak_rss_bytes'])} GiB (/ estimate {_num(planned.get('rss_over_estimate'))})"]
    llama = sections.get("llama_trainer", {})
    if llama.get("ok"):
        m, e, p = llama["measured"], llama["estimate"], llama["predicted"]
        lines += ["", f"## (d'') Llama 8B shape through the Trainer ({llama['plan']}, micro-batch "
                      f"{llama['micro_batch']} x {llama['seq_len']}, accumulation {llama['gradient_accumulation']})",
                  "", f"{m['tokens_per_s']:.0f} tokens/s (predicted {_num(p.get('tokens_per_s'), '.0f')}), MFU "
                      f"{_num(llama['mfu'])}, {m['step_s']:.2f} s per step (predicted {_num(p.get('step_s'))}), "
                      f"peak device {_gib(m['peak_device_bytes_steps'])} GiB (/ estimate "
                      f"{_num(llama.get('device_over_estimate'))} of {_gib(e['device_bytes'])} GiB), peak host RSS "
                      f"{_gib(m['peak_rss_bytes'])} GiB (/ estimate {_num(llama.get('rss_over_estimate'))}); "
                      f"targets {llama['targets']}"]
    for name in ("gpt2_10b", "gpt2_10b_dpu"):
        if sections.get(name, {}).get("ok"):
            lines += _ten_b(name, sections[name])
    two = sections.get("two_gpus", {})
    if two.get("ranks"):
        lines += ["", "## (f) two GPUs, NCCL-only group, init_sharded, stage 3", ""]
        lines += [f"- {r}" for r in two["ranks"]]
    for name, s in sections.items():
        if not s.get("ok") and s.get("error"):
            lines += ["", f"## {name} failed", "", "```", *map(str, s["error"] if isinstance(s["error"], list)
                                                               else [s["error"]]), "```"]
    return "\n".join(lines) + "\n"
