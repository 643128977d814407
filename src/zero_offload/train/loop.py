"""The main job: train a GPT preset on real text through the engine, with progress, metrics, checkpoints,
a loss plot and a text sample. Only rank 0 prints and writes files."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

import zero_offload
from zero_offload.checkpoint import CheckpointError, prune_checkpoints, resolve_tag
from zero_offload.checkpoint.io import write_errors
from zero_offload.checkpoint.lock import DirectoryLock, LockedError
from zero_offload.comm import DistContext, barrier, broadcast_object
from zero_offload.config import Config, ConfigError
from zero_offload.sequence import groups as sequence_groups
from zero_offload.sequence.gpt import make_sequence_parallel, sequence_parallel_off, shard
from zero_offload.train.data import prepare_data
from zero_offload.train.model import GPT, count_parameters, flops_per_token, preset
from zero_offload.train.planning import choose_config, needs_sharded_init, peak_flops
from zero_offload.train.report import plot_losses, plot_step_times, write_sample

__all__ = ["TrainArgs", "default_config", "train"]

EVAL_BATCHES = 8   # validation batches per evaluation: enough for a stable curve on the tiny preset


@dataclass
class TrainArgs:
    """The `zero-offload train` flags (see `cli.py` for their help)."""
    model: str = "tiny"
    config: str | None = None
    seq_len: int | None = None
    steps: int = 600
    eval_every: int = 100
    save_every: int = 200
    out: str = "runs/tiny"
    resume: bool = False
    keep_last: int = 3
    seed: int = 1337
    data: str | None = None
    tokenizer: str = "bpe"
    precision: str = "auto"
    lr: float | None = None
    allow_stale_step: bool = False
    allow_bf16_masters: bool = False
    allow_bf16_moments: bool = False
    sequence_parallel: int = 1


def default_config(steps: int, device: torch.device) -> dict:
    """The seed's configuration (DeepSpeed's ZeRO-Offload tutorial: stage 2, optimizer on the CPU,
    contiguous gradients, overlapped communication), with a schedule sized to ``steps``."""
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": _bf16_is_fast(device)},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(1, steps), "warmup_num_steps": min(50, max(2, steps // 10)),
            "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "contiguous_gradients": True, "overlap_comm": True},
    }


def _bf16_is_fast(device: torch.device) -> bool:
    # bf16 pays off on GPUs that support it; on CPUs torch's bf16 kernels are slower than fp32 for small
    # models even with AVX512-BF16, so the CPU default is fp32.
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def _raw_config(args: TrainArgs, device: torch.device) -> dict:
    """The main job's defaults, or ``--config``, with ``--precision`` and ``--lr`` applied."""
    raw = default_config(args.steps, device) if args.config is None else Config.load(args.config).to_dict()
    if args.config is not None:
        raw = {k: v for k, v in raw.items() if v is not None}
        raw["scheduler"] = raw.get("scheduler")
        if raw["scheduler"] is None:
            raw.pop("scheduler")
    if args.precision != "auto":
        raw["fp16"] = {**raw.get("fp16", {}), "enabled": args.precision == "fp16"}
        raw["bf16"] = {"enabled": args.precision == "bf16"}
    if not raw.get("optimizer"):
        raise ConfigError(f"config key 'optimizer' is missing in '{args.config}': zero-offload has no default "
                          f"optimizer")
    if args.lr is not None:
        raw["optimizer"].setdefault("params", {})["lr"] = args.lr
    if args.sequence_parallel != 1:
        raw["sequence_parallel_size"] = args.sequence_parallel
    Config.load(raw)     # a bad override fails here, naming the key
    return raw


def _log(rank: int, *msg) -> None:
    if rank == 0:
        print(*msg, flush=True)


def train(args: TrainArgs) -> dict:
    """Run the job; returns {"first_val_loss", "last_val_loss", "steps", "seconds"}.

    Rank 0 holds ``--out/.lock`` for the whole run, so two runs never interleave their checkpoints and
    metrics.

    Raises:
        ValueError: an unknown preset, ``--seq-len`` beyond the preset's context, or bad data.
        FileNotFoundError: a missing ``--data`` path.
        CheckpointError: ``--resume`` with no checkpoint in ``--out``; a failed save (`DiskFullError` names
            the file and the bytes it needs).
        LockedError: another run uses ``--out`` (names the directory and its pid).
    """
    t_start = time.perf_counter()
    cfg_model = preset(args.model)           # fails early on an unknown preset
    seq_len = args.seq_len or cfg_model.block_size
    if not 1 <= seq_len <= cfg_model.block_size:
        raise ValueError(f"--seq-len {seq_len} is beyond the context of preset '{args.model}' "
                         f"({cfg_model.block_size} tokens)")
    ctx = DistContext.create()
    # Before any work: the planner's config for this machine (no --config), or a check that --config fits.
    try:
        choice = choose_config(cfg_model, args.model, _raw_config(args, ctx.device), args.config,
                               ctx.world_size, ctx.device, seq_len, args.allow_stale_step,
                               args.allow_bf16_masters, args.allow_bf16_moments)
    except ValueError as e:
        choice = e
    if ctx.distributed:   # every rank takes rank 0's choice (free memory differs a little between ranks)
        choice = broadcast_object(choice)
    if isinstance(choice, Exception):
        raise choice
    _log(ctx.rank, choice.message)
    config = Config.load(choice.raw)   # a typo in the config costs no data or model work
    config.batch_sizes(ctx.world_size // config.sequence_parallel_size)
    out = Path(args.out)
    lock = _lock_out(out, ctx)
    try:
        return _train(args, ctx, config, choice, out, t_start)
    finally:
        if lock is not None:
            lock.release()


def _lock_out(out: Path, ctx: DistContext) -> DirectoryLock | None:
    """Rank 0 locks ``out`` for the run; every rank fails together when another run holds it."""
    lock, message = None, None
    if ctx.rank == 0:
        try:
            lock = DirectoryLock(out, "in use").acquire()
        except LockedError as e:
            message = str(e)
    if ctx.distributed:
        message = broadcast_object(message)
    if message is not None:
        raise LockedError(f"--out {message}")
    return lock


def _train(args: TrainArgs, ctx: DistContext, config: Config, choice, out: Path, t_start: float) -> dict:
    seq_len = args.seq_len or preset(args.model).block_size
    ckpt_dir = out / "checkpoints"
    if args.resume:
        try:
            resolve_tag(ckpt_dir)
        except CheckpointError as e:
            raise CheckpointError(f"--resume: no checkpoint to resume from in '{out}' ({e})") from None
    data = _prepare(args, ctx, out)
    torch.manual_seed(args.seed)
    model_cfg = preset(args.model, vocab_size=data.vocab_size)
    if needs_sharded_init(model_cfg, choice.raw, ctx.world_size):
        # No rank holds the whole model: built unit by unit; GPT's own initialisation writes through.
        with zero_offload.init_sharded():
            model = GPT(model_cfg)
    else:
        model = GPT(model_cfg)
    counts = count_parameters(model.config)
    _log(ctx.rank, f"model {args.model}: {counts.total / 1e6:.2f}M parameters "
                   f"({counts.non_embedding / 1e6:.2f}M non-embedding), vocab {data.vocab_size}, "
                   f"context {seq_len}, {ctx.world_size} rank(s) on {ctx.device.type}")
    wd = config.optimizer.params.weight_decay
    # Ulysses: the ranks of a group load the same batch and take a shard each; the attention cores are wrapped first
    make_sequence_parallel(model, sequence_groups.initialize(config.sequence_parallel_size))
    engine = zero_offload.initialize(model, config, model_parameters=model.optimizer_groups(wd))
    sp = engine.sequence
    start = 0
    if args.resume:
        start = engine.load_checkpoint(ckpt_dir)["step"]
        _log(ctx.rank, f"resumed from step {start} ({ckpt_dir})")
    metrics = _Metrics(out, ctx.rank, resume_step=start if args.resume else None)
    micro, gas = engine.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps
    tokens_per_step = micro * gas * sp.data_parallel_size * seq_len
    flops_token, peak = flops_per_token(model_cfg, seq_len), peak_flops(ctx.device)
    first_val = last_val = None
    if start == 0:
        first_val = last_val = _evaluate(engine, data, micro, seq_len, ctx, args.seed)
        metrics.write({"step": 0, "val_loss": first_val})
    bar = _progress(ctx.rank, start, args.steps)
    try:
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=ctx.device)
            for k in range(gas):
                x, y = data.get_batch("train", micro, seq_len, rank=sp.data_parallel_rank,
                                      world_size=sp.data_parallel_size, seed=args.seed, step=step * gas + k)
                x, y, positions = shard(x.to(ctx.device), y.to(ctx.device), sp)
                _, loss = engine(x, y, position_ids=positions)
                loss = engine.sequence_parallel_loss(loss, y, ignore_index=-1)
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float() / gas
            loss_value = _mean_over_ranks(loss_sum, ctx)
            dt = time.perf_counter() - t0
            record = {"step": step + 1, "loss": loss_value, "lr": engine.get_lr()[0],
                      "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                      **{k: round(v, 6) for k, v in engine.timings.items()}, **_memory(ctx.device),
                      **engine.stats.as_dict()}
            if ctx.device.type == "cuda":
                # Model FLOPs (6N + attention per token, no recompute counted) per GPU, and MFU against its peak.
                record["tflops"] = tokens_per_step / dt * flops_token / ctx.world_size / 1e12
                if peak:
                    record["mfu"] = record["tflops"] * 1e12 / peak
            metrics.write(record)
            if bar is not None:
                bar.update(1)
                extra = {k: f"{record[k]:.1f}" if k == "tflops" else f"{record[k]:.1%}"
                         for k in ("tflops", "mfu") if k in record}
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", **extra,
                                host_gb=f"{record['host_mem_gb']:.1f}", syncs=engine.stats.host_syncs,
                                **({"dev_gb": f"{record['device_mem_gb']:.1f}"} if "device_mem_gb" in record else {}))
            done = step + 1
            if done % args.eval_every == 0 or done == args.steps:
                last_val = _evaluate(engine, data, micro, seq_len, ctx, args.seed)
                metrics.write({"step": done, "val_loss": last_val})
                if bar is not None:
                    bar.write(f"step {done}: train loss {loss_value:.4f}, val loss {last_val:.4f}")
            if done % args.save_every == 0 or done == args.steps:
                engine.save_checkpoint(ckpt_dir, client_state={"step": done})
                if ctx.rank == 0:
                    prune_checkpoints(ckpt_dir, args.keep_last)
    finally:
        if bar is not None:   # on an error too: the message then starts on its own line
            bar.close()
    # Every rank generates (stage 3 gathers parameters collectively); rank 0 writes and prints.
    with sequence_parallel_off(engine.module):
        text = write_sample(engine.module, data, out / "sample.txt" if ctx.rank == 0 else None, ctx.device,
                            seed=args.seed)
    if ctx.rank == 0:
        plot_losses(out / "metrics.jsonl", out / "loss.png")
        plot_step_times(out / "metrics.jsonl", out / "timeline.png")     # none where no step was timed
        print(f"--- sample ---\n{text}\n--------------")
    result = {"first_val_loss": first_val if first_val is not None else metrics.first_val(),
              "last_val_loss": last_val, "steps": args.steps, "seconds": time.perf_counter() - t_start}
    if ctx.rank == 0 and result["first_val_loss"] and last_val:
        drop = 1 - last_val / result["first_val_loss"]
        print(f"validation loss {result['first_val_loss']:.4f} -> {last_val:.4f} ({drop:.1%} lower) in "
              f"{result['seconds']:.0f} s; outputs in {out}")
    return result


def _prepare(args: TrainArgs, ctx: DistContext, out: Path):
    """Rank 0 builds (or validates) the token cache first; the other ranks then read it."""
    cache = out / "data_cache"
    kwargs = dict(tokenizer=args.tokenizer)
    if ctx.rank == 0:
        with write_errors(cache, _corpus_bytes(args.data), "the token cache", only_disk_full=True):
            data = prepare_data(cache, args.data, **kwargs)
    barrier()
    if ctx.rank != 0:
        data = prepare_data(cache, args.data, **kwargs)
    return data


@torch.no_grad()
def _evaluate(engine, data, micro: int, seq_len: int, ctx: DistContext, seed: int) -> float:
    """The mean validation loss; whole sequences on every rank (a sequence-parallel group's ranks alike)."""
    engine.module.eval()
    total = torch.zeros((), device=ctx.device)
    sp = engine.sequence
    with sequence_parallel_off(engine.module):
        for i in range(EVAL_BATCHES):
            x, y = data.get_batch("val", micro, seq_len, rank=sp.data_parallel_rank,
                                  world_size=sp.data_parallel_size, seed=seed, step=i)
            _, loss = engine.module(x.to(ctx.device), y.to(ctx.device))
            total += loss.float()
    engine.module.train()
    return _mean_over_ranks(total / EVAL_BATCHES, ctx)


def _mean_over_ranks(value: torch.Tensor, ctx: DistContext) -> float:
    if ctx.distributed:
        value = value.clone()
        ctx.all_reduce(value, async_op=False)
        value /= ctx.world_size
    return float(value)


def _memory(device: torch.device) -> dict:
    out = {"host_mem_gb": psutil.Process().memory_info().rss / 2**30}
    if device.type == "cuda":
        out["device_mem_gb"] = torch.cuda.memory_allocated(device) / 2**30
        out["device_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _progress(rank: int, start: int, total: int):
    if rank != 0:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0)


def _corpus_bytes(data: str | None) -> int:
    """About the bytes of token cache a corpus needs (4 bytes per byte of text at worst, as int32 ids)."""
    if data is None or not Path(data).exists():
        return 0
    path = Path(data)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return 4 * sum(f.stat().st_size for f in files)


class _Metrics:
    """metrics.jsonl: one JSON line per step and per evaluation (rank 0 only). On resume the file is cut back
    to the resumed step, so the steps redone after it are not listed twice."""

    def __init__(self, out: Path, rank: int, resume_step: int | None):
        self.path = out / "metrics.jsonl"
        self.rank = rank
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if resume_step is None or not self.path.exists():
                self.path.write_text("")
            else:
                kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept))
                tmp.replace(self.path)

    def write(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def first_val(self) -> float | None:
        if self.rank != 0 or not self.path.exists():
            return None
        for line in self.path.read_text().splitlines():
            rec = json.loads(line)
            if "val_loss" in rec:
                return rec["val_loss"]
        return None


def _step_of(line: str) -> float:
    """The step of a metrics line; a torn last line (a run killed mid-write) sorts after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
