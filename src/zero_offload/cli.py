"""`zero-offload` command line: train (the main job), estimate, calibrate, bench optimizer, consolidate, convert, run.

Only this module imports `train/`; the library never does.
"""
from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _train_parser(sub) -> None:
    from zero_offload.train.loop import TrainArgs
    d = TrainArgs()
    p = sub.add_parser("train", help="train a GPT on real text (the main job)",
                       description="Train a GPT preset through the ZeRO engine. With no flags: the `tiny` "
                                   "preset on the Python standard library's source, ZeRO stage 2 with the "
                                   "optimizer offloaded to the CPU (the DeepSpeed ZeRO-Offload tutorial's "
                                   "config).")
    p.add_argument("--model", default=d.model, help="preset: tiny (default), gpt2, gpt2-medium, gpt2-large, "
                                                    "gpt2-xl, gpt2-10b")
    p.add_argument("--config", default=d.config, help="DeepSpeed-style JSON config (default: stage 2 + "
                                                      "offload_optimizer cpu, bf16 on GPUs that support it)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default: the preset's "
                                                                  "context)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation losses")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints (one is "
                                                                        "always saved at the end)")
    p.add_argument("--out", default=d.out, help=f"output directory: metrics.jsonl, loss.png, sample.txt, "
                                                f"checkpoints/, data_cache/ (default {d.out})")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out (metrics.jsonl "
                                                         "is cut back to the resumed step)")
    p.add_argument("--keep-last", type=int, default=d.keep_last, help=f"checkpoints kept in --out/checkpoints, the "
                                                                     f"newest (default {d.keep_last})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for the model and the data order")
    p.add_argument("--data", default=d.data, help="a text file or a directory of text files (default: the "
                                                  "Python standard library's source)")
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default=d.tokenizer,
                   help="byte-level BPE trained on the corpus (default) or raw bytes")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default=d.precision,
                   help="override the config's precision (auto keeps it)")
    p.add_argument("--lr", type=float, default=d.lr, help="override the config's learning rate")
    p.add_argument("--allow-stale-step", action="store_true",
                   help="without --config: let the plan turn on the delayed parameter update, which trains each "
                        "step on parameters one step old (default: exact)")
    p.add_argument("--allow-bf16-masters", action="store_true",
                   help="without --config: let the plan keep bf16 master weights (DeepSpeed's "
                        "bf16_master_weights_and_grads; default: fp32 masters)")
    p.add_argument("--allow-bf16-moments", action="store_true",
                   help="without --config: let the plan keep Adam's moments in bf16 on the host (DeepSpeed's "
                        "bf16.bf16_optimizer_states; default: fp32 moments)")
    p.add_argument("--sequence-parallel", type=int, default=d.sequence_parallel, metavar="N",
                   help="Ulysses sequence parallelism: N ranks share each sequence (the config's "
                        "sequence_parallel_size; the world size must be a multiple of N; default 1)")


def _estimate_parser(sub) -> None:
    p = sub.add_parser("estimate", help="memory per rank of every ZeRO stage x offload, and a plan",
                       description="Per-rank device, host and NVMe bytes of every ZeRO stage x offload choice for "
                                   "a model, whether each fits this machine (or the hardware given), and the "
                                   "planner's choice (marked *). Sizes: 80GB (10^9), 24GiB (2^30), 512MiB; a bare "
                                   "number is GB (--gpu-mem 80 is 80GB).")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default=None, help="a GPT preset: tiny, gpt2, gpt2-medium, gpt2-large, "
                                                    "gpt2-xl, gpt2-10b (default tiny)")
    what.add_argument("--params", default=None, help="a bare parameter count: 10e9, 10B, 350M")
    what.add_argument("--hf-config", default=None, help="a Hugging Face config.json (decoder sizes)")
    what.add_argument("--largest", action="store_true", help="the largest GPT-2-shaped model that trains on this "
                                                             "machine (or the hardware given), its plan and MFU")
    p.add_argument("--longest", action="store_true", help="the longest sequence the model (--model or --hf-config) "
                                                          "trains at on this machine (or the hardware given), with "
                                                          "its plan")
    p.add_argument("--gpus", type=int, default=None, help="ranks on this machine (default: its GPUs, or 1)")
    p.add_argument("--gpu-mem", default=None, help="memory per GPU: 80GB, 24GiB, or a bare number of GB "
                                                   "(default: this machine's; 0 = no GPU)")
    p.add_argument("--host-mem", default=None, help="host memory for all ranks: 128GB, 64GiB, or a bare number "
                                                    "of GB (default: this machine's RAM)")
    p.add_argument("--nvme", default=None, help="NVMe space: 2TB, 500GiB, or a bare number of GB (default: none)")
    p.add_argument("--micro-batch", default=None, help="sequences per micro-batch (default: the config's, else "
                                                       "chosen; without a GPU 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's context)")
    p.add_argument("--grad-accum", default=None, help="gradient accumulation steps (default: the config's, "
                                                      "else chosen to hide the host step behind device compute)")
    p.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="recompute activations in backward (default auto: chosen for a GPT preset)")
    p.add_argument("--gpu-tflops", default=None, help="sustained TFLOP/s of one GPU in training, for the step "
                                                      "model (default 400)")
    p.add_argument("--host-adam", default=None, help="host Adam parameters/s with fp32 moments, the kernel alone, "
                                                     "e.g. 4.2e9 (default 4.2e9, a GPU server's; the step is charged "
                                                     "at 0.77 of it beside training; measure yours: zero-offload "
                                                     "calibrate)")
    p.add_argument("--pcie", default=None, help="host <-> GPU copy GB/s each way (default 25)")
    p.add_argument("--nvme-gbps", default=None, help="swap-file GB/s each way of one rank, for plans with NVMe "
                                                     "(default 2.5; measure yours: zero-offload calibrate "
                                                     "--nvme-path DIR)")
    p.add_argument("--calibration", default=None, help="rates measured by `zero-offload calibrate` (default: "
                                                       "$ZERO_OFFLOAD_CALIBRATION or ~/.cache/zero_offload/"
                                                       "calibration.json when it exists, else built-in); the "
                                                       "--gpu-tflops, --host-adam, --pcie and --nvme-gbps flags "
                                                       "override it")
    p.add_argument("--config", default=None, help="base config: its precision and optimizer are kept, and its "
                                                  "batch sizes when set; the plan picks stage, offload, and the "
                                                  "batch settings it does not set (default: bf16, AdamW)")
    p.add_argument("--allow-stale-step", action="store_true",
                   help="let the plan turn on the delayed parameter update, which trains each step on parameters "
                        "one step old (default: exact; the plan says what it would gain)")
    p.add_argument("--allow-bf16-masters", action="store_true",
                   help="let the plan keep bf16 master weights (DeepSpeed's bf16_master_weights_and_grads: 8 "
                        "instead of 10 host bytes per parameter; updates below half a bf16 ulp are lost)")
    p.add_argument("--allow-bf16-moments", action="store_true",
                   help="let the plan keep Adam's moments in bf16 on the host (DeepSpeed's bf16_optimizer_states: "
                        "10 instead of 14 host bytes per parameter; each moment rounded to bf16 at every step)")
    p.add_argument("--write-config", default=None, help="write the planned config to this JSON file")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the plan into this image (.png, .pdf or .svg): bytes per kind on the device, in host "
                        "memory and on NVMe against each capacity, and the step model's timeline of one step")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's estimator columns")


def _run_train(ns) -> int:
    from zero_offload.train.loop import TrainArgs, train
    args = TrainArgs(**{k: v for k, v in vars(ns).items() if k in TrainArgs.__dataclass_fields__})
    for flag in ("steps", "eval_every", "save_every", "keep_last"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    train(args)
    return 0


def _run_stand_in(argv: list[str]) -> int:
    """`zero-offload run`: its arguments are CMD's own, so they bypass argparse (`zero_offload.launcher`)."""
    from zero_offload.launcher import LaunchError, run
    try:
        return run(argv)
    except LaunchError as e:
        print(f"zero-offload run: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="zero-offload", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _estimate_parser(sub)
    bench = sub.add_parser("bench", help="measured speed against peers: `bench optimizer ...`",
                           add_help=False)
    bench.add_argument("what", choices=("optimizer",))
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("run", help="run a DeepSpeed codebase unchanged: `run [--] CMD ARGS` (python, torchrun, "
                               "accelerate launch, deepspeed, a shell script), zero-offload standing in for DeepSpeed",
                   add_help=False)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        return _run_stand_in(argv[1:])
    if argv[:1] == ["bench"] and len(argv) >= 2 and argv[1] == "optimizer":
        from zero_offload.bench.optimizer import main as bench_optimizer
        return bench_optimizer(argv[2:])
    cal = sub.add_parser("calibrate", help="measure this machine's rates for the step model (JSON)",
                         description="Measure the bf16 matmul FLOP/s, pinned host <-> device GB/s each way and "
                                     "the host Adam kernel's parameters/s, and write them as JSON for `estimate "
                                     "--calibration` and `zero_offload.plan(calibration=...)`. Without a GPU: the "
                                     "host side only.")
    from zero_offload.calibrate import default_path
    cal.add_argument("--out", default=str(default_path()), help=f"the JSON file (default {default_path()}, or "
                                                                "$ZERO_OFFLOAD_CALIBRATION)")
    cal.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="auto (default): CUDA when present; cpu: the host side only")
    cal.add_argument("--nvme-path", default=None, help="a swap directory (offload_optimizer.nvme_path) to measure "
                                                       "NVMe read and write GB/s in, with a 1 GiB file")
    cal.add_argument("--cores-perc", type=float, default=0.8,
                     help="share of cores a delayed host step gets (offload_optimizer.cpuadam_cores_perc, 0.8)")
    cons = sub.add_parser("consolidate", help="a sharded checkpoint to one safetensors file",
                          description="Gather the fp32 master weights of a checkpoint, parameter by parameter, "
                                      "into one safetensors file under the model's parameter names.")
    cons.add_argument("dir", help="the checkpoint directory (the one holding `latest`)")
    cons.add_argument("--tag", default=None, help="which checkpoint (default: the one `latest` names)")
    cons.add_argument("--out", default="model.safetensors", help="output file (default model.safetensors)")
    cons.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="tensor dtype in the file")
    conv = sub.add_parser("convert", help="a checkpoint to another framework's format (offline, no GPU)",
                          description="Rewrite a checkpoint of zero-offload, DeepSpeed (ZeRO stage 1-3 or universal) "
                                      "or FSDP2 (DCP) as zero-offload's, DeepSpeed's universal layout or DCP, with "
                                      "master weights, Adam's moments, the step, the loss scale and the LR schedule, "
                                      "on one process without the model's code.")
    conv.add_argument("src", help="the checkpoint directory (the one holding `latest`, or a DCP directory)")
    conv.add_argument("dst", help="where to write (a save directory; for dcp the DCP directory)")
    conv.add_argument("--to", required=True, choices=("zero-offload", "deepspeed-universal", "dcp"))
    conv.add_argument("--tag", default=None, help="which checkpoint of src (default: the latest)")
    conv.add_argument("--config", default=None, help="the training config (JSON/hjson; needed for a DCP source, "
                                                     "which carries none)")
    conv.add_argument("--dcp-model-key", default="", help="--to dcp: the model's key path (dotted; default '', the "
                                                          "top level, as torchtitan writes; 'model', 'app.model')")
    conv.add_argument("--dcp-optim-key", default="optimizer", help="--to dcp: the optimizer's key path (default "
                                                                   "'optimizer', torchtitan's; 'optim', 'app.optim')")
    conv.add_argument("--trust-pickles", action="store_true", help="load pickled state holding types outside the "
                      "allow-list of data types (unpickling them can run code the file names: trusted files only)")
    ns = parser.parse_args(argv)
    from zero_offload.checkpoint import CheckpointError
    from zero_offload.checkpoint.lock import LockedError
    from zero_offload.comm import CollectiveTimeoutError
    from zero_offload.config import ConfigError
    from zero_offload.precision import LossScaleError
    # Failures a person can act on: one line and exit status 2, no traceback.
    known = (ConfigError, CheckpointError, ValueError, OSError, LockedError, CollectiveTimeoutError, LossScaleError)
    try:
        if ns.command == "train":
            return _run_train(ns)
        if ns.command == "estimate":
            from zero_offload.estimate.table import run_estimate
            return run_estimate(ns)
        if ns.command == "calibrate":
            from zero_offload.calibrate import measure, write
            result = measure(ns.device, ns.cores_perc, nvme_path=ns.nvme_path)
            path = write(result, ns.out)
            print(json.dumps(result["constants"], indent=1))
            print(f"wrote {path}")
            return 0
        if ns.command == "consolidate":
            from zero_offload.checkpoint.consolidate import export_safetensors
            path = export_safetensors(ns.dir, ns.out, ns.tag, ns.dtype)
            print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
            return 0
        if ns.command == "convert":
            from zero_offload.checkpoint.convert import convert, describe
            print(describe(convert(ns.src, ns.dst, ns.to, ns.tag, ns.config, (ns.dcp_model_key, ns.dcp_optim_key),
                                    ns.trust_pickles)))
            return 0
        parser.error(f"unknown command {ns.command}")
    except known as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"zero-offload {ns.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
