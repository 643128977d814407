"""Extractors: from one benchmark's result (the JSON it writes, or its stdout) to a row's `Figures`.

Each factory names the benchmark it reads and the keys it takes; units are in the printed cells (ms, s, GB/s with
GB = 1e9 bytes, MiB = 2**20 bytes, Gparam/s = 1e9 parameters per second). Ratios are ours / the peer's figure as
shown, to 2 decimals, unless the cell says "paired" (the benchmark's own median of per-round or per-step ratios).
"""
from __future__ import annotations

import json
import re
import statistics
from typing import Any, Callable

from benchmarks.report_types import Figures, RowError

Extractor = Callable[[Any], Figures]


def host_adam(ours_path: str, peer_path: str, peer_label: str) -> Extractor:
    """`zero_offload.bench.optimizer --json`: ``rows[].path`` / ``gparams_per_s`` (1e9 parameters per second)."""
    def extract(result: dict) -> Figures:
        rows = {r["path"]: r for r in result["rows"]}
        for path in (ours_path, peer_path):
            if path not in rows or "error" in rows[path]:
                raise RowError(f"{path}: {rows.get(path, {}).get('error', 'not in the result')}")
        ours, peer = rows[ours_path]["gparams_per_s"], rows[peer_path]["gparams_per_s"]
        return Figures(f"{ours:.2f} Gparam/s", f"{peer_label} {peer:.2f} Gparam/s", f"{ours / peer:.2f}x")
    return extract


def engine_step(peer_engine: str, world_size: int, peer_label: str) -> Extractor:
    """`bench_engine.py --json`: ``results[]`` by (``engine``, ``world_size``), median ``step_s`` (slowest rank)."""
    def extract(result: dict) -> Figures:
        by = {(r["engine"], r["world_size"]): r for r in result["results"]}
        got = []
        for engine in ("ours", peer_engine):
            r = by.get((engine, world_size))
            if r is None or r.get("status") != "ok":
                raise RowError(f"{engine} at world size {world_size}: {r and r.get('error') or 'not run'}")
            got.append(1e3 * r["step_s"])
        ours, peer = got
        return Figures(f"{ours:.1f} ms/step", f"{peer_label} {peer:.1f} ms/step", f"{ours / peer:.2f}x")
    return extract


def trainer_step(variant: str) -> Extractor:
    """`bench_trainer.py --json`: ``variants[v].step_s_per_round`` (median step per round, s) and ``ratio`` (ours /
    plain paired within each round, median over rounds)."""
    def extract(result: dict) -> Figures:
        ours, plain = result["variants"][variant], result["variants"]["plain"]
        return Figures(f"{statistics.median(ours['step_s_per_round']):.3f} s/step",
                       f"plain Trainer (torch AdamW) {statistics.median(plain['step_s_per_round']):.3f} s/step",
                       f"{ours['ratio']:.2f}x paired")
    return extract


def stand_in(key: str) -> Extractor:
    """`bench_stand_in.py --json`: ``median[side][key]`` (s) of both sides and ``ratio_step`` / ``ratio_startup``."""
    def extract(result: dict) -> Figures:
        med = result["median"]
        ratio = result["ratio_step" if key == "step_s" else "ratio_startup"]
        if key == "step_s":
            return Figures(f"{1e3 * med['stand-in'][key]:.1f} ms/step",
                           f"direct import {1e3 * med['direct'][key]:.1f} ms/step", f"{ratio:.3f}x")
        return Figures(f"{med['stand-in'][key]:.2f} s", f"direct import {med['direct'][key]:.2f} s", f"{ratio:.3f}x")
    return extract


def _largest_pair(result: list) -> tuple[dict, dict]:
    """The largest model that both engines saved and loaded in a `bench_checkpoint.py` result."""
    ok = {(r["engine"], r["model"]): r for r in result if "error" not in r}
    models = [r for (engine, model), r in ok.items() if engine == "ours" and ("deepspeed", model) in ok]
    if not models:
        raise RowError("no model with both ours and DeepSpeed's checkpoint")
    ours = max(models, key=lambda r: r["parameters"])
    return ours, ok["deepspeed", ours["model"]]


def checkpoint(key: str) -> Extractor:
    """`bench_checkpoint.py --json` (a list, one record per engine and model): ``save_s`` or ``load_s`` (median s)
    and ``bytes`` written, for the largest model both engines ran."""
    def extract(result: list) -> Figures:
        ours, peer = _largest_pair(result)
        if key == "save_s":
            return Figures(f"{ours[key]:.2f} s, {ours['bytes'] / 2**20:.0f} MiB",
                           f"DeepSpeed {peer[key]:.2f} s, {peer['bytes'] / 2**20:.0f} MiB",
                           f"{ours[key] / peer[key]:.2f}x")
        return Figures(f"{ours[key]:.2f} s", f"DeepSpeed {peer[key]:.2f} s", f"{ours[key] / peer[key]:.2f}x")
    return extract


def consolidate(result: list) -> Figures:
    """`bench_checkpoint.py --json`: ours' ``consolidate`` record: peak anonymous MiB of `zero-offload consolidate`
    and of a process that only imports it, against the fp32 file written (MiB)."""
    ours, _ = _largest_pair(result)
    c = ours["consolidate"]
    extra = c["consolidate_peak_mib"] - c["import_only_peak_mib"]
    return Figures(f"+{extra:.0f} MiB anon above import ({c['consolidate_peak_mib']:.0f} peak)",
                   f"the fp32 model file {c['file_mib']:.0f} MiB", f"{extra / c['file_mib']:.2f}x")


CONVERT_OURS, CONVERT_PEER = "zero-offload convert", "DeepSpeed ds_to_universal.py"


def _convert_seconds(stdout: str) -> dict[str, float]:
    """`bench_convert_memory.py`'s table lines: the converter's name padded to 40 characters, seconds last."""
    seconds = {}
    for line in stdout.splitlines():
        name, fields = line[:40].rstrip(), line[40:].split()
        if len(fields) == 5 and name in (CONVERT_OURS, CONVERT_PEER):
            seconds[name] = float(fields[-1])
    return seconds


def _last_json(stdout: str) -> dict:
    """The last line of ``stdout`` that is a JSON object."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RowError("no JSON line in the output")


def convert(measure: str) -> Extractor:
    """`bench_convert_memory.py`'s stdout: its last line's ``peak_anonymous_mib`` (MiB) per converter, or the seconds
    of its table, for ``convert --to deepspeed-universal`` against DeepSpeed's ``ds_to_universal.py``."""
    def extract(result: dict) -> Figures:
        if measure == "memory":
            anon = _last_json(result["stdout"])["peak_anonymous_mib"]
            ours, peer = anon[CONVERT_OURS], anon[CONVERT_PEER]
            return Figures(f"{ours:.0f} MiB anon", f"ds_to_universal.py {peer:.0f} MiB anon", f"{ours / peer:.2f}x")
        seconds = _convert_seconds(result["stdout"])
        ours, peer = seconds[CONVERT_OURS], seconds[CONVERT_PEER]
        return Figures(f"{ours:.1f} s", f"ds_to_universal.py {peer:.1f} s", f"{ours / peer:.2f}x")
    return extract


def nvme_swapper(result: dict) -> Figures:
    """`bench_nvme.py --out`: ``swapper`` and ``deepspeed_aio`` best-of-rounds bytes/s each way, and the swapper / aio
    ratio paired within each round (median)."""
    ours, peer = result["swapper"], result["deepspeed_aio"]
    if "error" in peer:
        raise RowError(f"DeepSpeed aio: {peer['error']}")
    return Figures(f"{ours['write'] / 1e9:.2f} / {ours['read'] / 1e9:.2f} GB/s",
                   f"DeepSpeed aio {peer['write'] / 1e9:.2f} / {peer['read'] / 1e9:.2f} GB/s",
                   f"{ours['write_vs_deepspeed_paired']:.2f} / {ours['read_vs_deepspeed_paired']:.2f}x paired")


def nvme_host_step(result: dict) -> Figures:
    """`bench_nvme.py --out`: ``host_step``'s best ``step_s`` against ``io_overlapped_bound_s`` (the slower direction
    at the disk's best `dd` bandwidth)."""
    step = result["host_step"]
    best = min(step["step_s"])
    return Figures(f"{best:.2f} s/step", f"I/O bound {step['io_overlapped_bound_s']:.2f} s",
                   f"{step['ratio_to_overlapped_bound']:.2f}x")


def plan_cache(path: str) -> Extractor:
    """`bench_plan_cache.py --json`: per path, ``median_s`` of the first launch (cold: records every structure) and of
    a later one (warm: reads the recordings), their ratio, and whether every launch made the same plan."""
    def extract(result: dict) -> Figures:
        r = result[path]
        same = "" if r["same_plan"] else ", NOT the same plan"
        return Figures(f"{r['median_s']['later']:.1f} s warm", f"first launch (cold) {r['median_s']['first']:.1f} s",
                       f"{r['later_over_first']:.3f}x{same}")
    return extract


def planner_verdict(result: dict) -> Figures:
    """`bench_planner.py --json`: per size, the planned config and ``planned_over_this_by_step`` (planned / other step
    time, median over step pairs; above 1 the other is faster); the worst pair over all sizes, and ``ok``."""
    worst, at = 0.0, ("", "")
    for size, r in result.items():
        for name, ratio in r["planned_over_this_by_step"].items():
            if name != r["planned"] and ratio > worst:
                worst, at = ratio, (name, size)
    planned = sorted({r["planned"] for r in result.values()})
    ok = all(r["ok"] for r in result.values())
    return Figures(f"planned {' / '.join(planned)} ({len(result)} sizes)", f"fastest other: {at[0]} at {at[1]}",
                   f"{worst:.2f} paired by step{'' if ok else ', NOT ok'}")


_TRL_ROUND = re.compile(r"round \d+: stage 2 \+ offload ([\d.]+) s/step; stage 3 \+ offload ([\d.]+) s/step")
_TRL_MEDIAN = re.compile(r"median ratio stage 3 / stage 2: ([\d.]+)")


def trl_grpo(result: dict) -> Figures:
    """`bench_trl_grpo.py`'s stdout: each round's s/step at stage 2 and 3, and the median of the per-round ratios."""
    rounds = [tuple(map(float, m.groups())) for m in _TRL_ROUND.finditer(result["stdout"])]
    median = _TRL_MEDIAN.search(result["stdout"])
    if not rounds or median is None:
        raise RowError("no round or median line in the output")
    s2, s3 = (statistics.median(r[k] for r in rounds) for k in (0, 1))
    return Figures(f"{s3:.3f} s/step", f"stage 2 {s2:.3f} s/step", f"{float(median.group(1)):.2f}x paired")


def muon_step(result: dict) -> Figures:
    """`bench_muon.py --json`: ``two_ranks`` median ``engine_step_s`` against ``reference_step_s`` (s)."""
    r = result["two_ranks"]
    return Figures(f"{r['engine_step_s']:.3f} s", f"DeepSpeed MuonWithAuxAdam {r['reference_step_s']:.3f} s",
                   f"{r['ratio']:.2f}x")


def muon_partition(result: dict) -> Figures:
    """`bench_muon.py --json`: ``host_side`` parameters/s of the native partition passes against torch's ops."""
    ours = result["host_side"]["muon_partition_native"]["params_per_s"]
    peer = result["host_side"]["muon_partition_torch"]["params_per_s"]
    return Figures(f"{ours / 1e6:.0f}M params/s", f"torch ops {peer / 1e6:.0f}M params/s", f"{ours / peer:.2f}x")


def host_bytes(result: dict) -> Figures:
    """`bench_bf16_masters.py --rss --json`: ``memory_breakdown()``'s host bytes per parameter
    (``breakdown_per_side.host``) with the gradient partition on the device against on the host."""
    runs = result["runs"]
    for name in ("masters-grads-on-device", "masters"):
        if "skipped" in runs.get(name, {"skipped": "not run"}):
            raise RowError(f"{name}: {runs.get(name, {}).get('skipped', 'not run')}")
    ours = runs["masters-grads-on-device"]["breakdown_per_side"]["host"]
    peer = runs["masters"]["breakdown_per_side"]["host"]
    return Figures(f"{ours:.2f} B/param", f"partition on the host {peer:.2f} B/param", f"{ours / peer:.2f}x")
