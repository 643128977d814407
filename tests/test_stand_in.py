"""The DeepSpeed stand-in (issue 57): ``zero-offload run -- CMD`` and ``ZERO_OFFLOAD_AS_DEEPSPEED=1`` make
``import deepspeed`` answer with zero-offload's face in every Python process, for both install kinds; the
``deepspeed`` launcher without DeepSpeed; what is not built imports and fails when used; the census of nine
codebases' DeepSpeed calls and the names the installed libraries reference resolve.
"""
import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import stand_in_names

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
ON = {"ZERO_OFFLOAD_AS_DEEPSPEED": "1"}
_PROBE = """
import importlib.metadata, importlib.util, json, sys
spec = importlib.util.find_spec("deepspeed")
torch_before = "torch" in sys.modules
out = {"origin": spec and spec.origin, "torch_before_import": torch_before}
if spec is not None:
    import deepspeed
    out["file"], out["version"] = deepspeed.__file__, deepspeed.__version__
    out["metadata"] = importlib.metadata.version("deepspeed")
    if "zero_offload" in deepspeed.__file__:
        import deepspeed.comm, zero_offload.deepspeed.comm
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        out["same_module"] = deepspeed.comm is zero_offload.deepspeed.comm
print(json.dumps(out))
"""


def _python(code: str, env: dict, args=(), cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    return {**env, **extra}


def _probe(env, args=(), code=_PROBE) -> dict:
    done = _python(code, env, args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_variable_makes_import_deepspeed_zero_offload_in_a_fresh_interpreter():
    """The installed hook (CI installs with ``pip install -e .``): find_spec, import, submodules, metadata; the
    hook itself imports nothing heavy (torch loads only when deepspeed is imported)."""
    got = _probe(_env(**ON))
    assert "zero_offload" in got["origin"] and "zero_offload" in got["file"], got
    assert got["version"] == got["metadata"] and got["version"].startswith("0.19.8+zo"), got
    assert got["same_module"] and not got["torch_before_import"], got


def test_without_the_variable_an_installed_deepspeed_stays_itself():
    got = _probe(_env())
    assert got["origin"] is None or "zero_offload" not in got["origin"], got
    for off in ("0", ""):
        got = _probe(_env(ZERO_OFFLOAD_AS_DEEPSPEED=off))
        assert got["origin"] is None or "zero_offload" not in got["origin"], (off, got)


def test_a_plain_install_ships_the_hook(tmp_path):
    """``pip install .`` (here into a target folder) puts the .pth at the root of site-packages; an interpreter
    that sees only that folder (no editable path hook) answers from it."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (target / "zero_offload_stand_in.pth").is_file()
    libraries = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    code = (f"import site, sys; site.addsitedir({str(target)!r}); sys.path += {libraries!r}\n" + _PROBE)
    got = _probe(_env(**ON), args=("-S",), code=code)    # -S: no site-packages .pth (the editable one) runs
    assert got["file"].startswith(str(target)) and got["same_module"], got


def _run(args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_offload", "run", *args], capture_output=True, text=True,
                          cwd=cwd, env=env or _env(), timeout=timeout)


def test_run_reaches_the_children_of_a_shell(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(f'#!/bin/sh\n"{sys.executable}" -c "import deepspeed, sys; print(deepspeed.__file__, '
                      f'sys.argv[1:])" "$@"\n')
    script.chmod(0o755)
    done = _run(["--", str(script), "--lr", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zero_offload" in done.stdout and "['--lr', '1']" in done.stdout, done.stdout


_RANK_SCRIPT = """
import argparse, json, os, sys
import deepspeed
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--tag")
args = parser.parse_args()
deepspeed.init_distributed()
import torch
t = torch.tensor([float(deepspeed.comm.get_rank() + 1)])
deepspeed.comm.all_reduce(t)
with open(f"rank{args.local_rank}.json", "w") as f:      # a file each: two ranks' stdout lines interleave
    json.dump({"argv": sys.argv[1:], "local_rank": args.local_rank, "env_local": os.environ["LOCAL_RANK"],
               "world": deepspeed.comm.get_world_size(), "sum": t.item(), "file": deepspeed.__file__,
               "exported": os.environ.get("ZO_FROM_DS_ENV")}, f)
"""


def test_run_deepspeed_launches_ranks_as_deepspeed_does(tmp_path):
    """No DeepSpeed needed: ``--num_gpus 2`` starts two ranks through torch's elastic launcher, each given
    ``--local_rank=N`` before its own arguments; ``.deepspeed_env`` is exported to them."""
    (tmp_path / "train.py").write_text(_RANK_SCRIPT)
    (tmp_path / ".deepspeed_env").write_text("ZO_FROM_DS_ENV=yes\n")
    from dist_utils import _free_port
    done = _run(["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "train.py", "--tag", "x"],
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_rank"] for r in ranks] == [0, 1] and [r["env_local"] for r in ranks] == ["0", "1"]
    assert all(r["argv"][0] == f"--local_rank={r['local_rank']}" and r["argv"][1:] == ["--tag", "x"] for r in ranks)
    assert all(r["world"] == 2 and r["sum"] == 3.0 and "zero_offload" in r["file"] and r["exported"] == "yes"
               for r in ranks), ranks


@pytest.mark.parametrize("flags, expect", [
    (["--hostfile", "{hostfile}"], ["hostfile", "2 host(s)", "torchrun --nnodes 2"]),
    (["--num_nodes", "2"], ["--num_nodes 2", "torchrun --nnodes 2"]),
    (["--include", "worker-1:0"], ["'worker-1'", "single node"]),
    (["--include", "localhost:0", "--num_gpus", "1"], ["cannot be given with --include"]),
    (["--exclude", "localhost:7"], ["slot(s) [7]"]),
    (["--autotuning", "run"], ["autotuner is not built"]),
])
def test_run_deepspeed_refuses_what_it_cannot_launch_by_name(tmp_path, flags, expect):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    done = _run(["deepspeed", *[f.format(hostfile=hostfile) for f in flags], "train.py"], cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    for word in expect:
        assert word in done.stderr, (word, done.stderr)


def test_run_without_a_command_or_with_an_unknown_one_says_so():
    assert "give the command" in _run([]).stderr
    done = _run(["--", "no-such-command-zo"])
    assert done.returncode == 2 and "not found" in done.stderr, done.stderr


_UNBUILT = """
import deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec
from deepspeed.moe.layer import MoE
from deepspeed.runtime.pipe.schedule import TrainSchedule
from deepspeed.compression.helper import recursive_getattr
from deepspeed.ops.op_builder.builder import OpBuilder
assert OpBuilder.is_rocm_pytorch() in (True, False)
assert recursive_getattr(deepspeed, "comm.get_rank") is deepspeed.comm.get_rank
class Mine(PipelineModule):   # subclassing at import time works, as in Megatron-DeepSpeed
    pass
for make in (lambda: Mine(layers=[]), lambda: MoE(hidden_size=4), lambda: deepspeed.init_inference(None),
             lambda: TrainSchedule.num_stages):
    try:
        make()
    except NotImplementedError as e:
        assert "not built in zero-offload" in str(e) and ";" in str(e), e
    else:
        raise SystemExit("no error")
print("ok")
"""


def test_what_is_not_built_imports_and_fails_when_used_naming_the_alternative():
    done = _python(_UNBUILT, _env(**ON))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _statuses(names) -> dict:
    done = subprocess.run([sys.executable, str(TESTS / "stand_in_names.py")], input="\n".join(names),
                          capture_output=True, text=True, env=_env(**ON), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_census_of_nine_codebases_is_provided():
    """Re-counted against the stand-in: every name two or more codebases use (outside tensor, pipeline and expert
    parallelism and compression) is provided, and at least 90 % of all (codebase, name) pairs outside them."""
    rows = [line.split("\t") for line in (TESTS / "data" / "deepspeed_api_census.tsv").read_text().splitlines()[1:]]
    rows = [(int(n), name) for n, name, _ in rows if not stand_in_names.EXCLUDED.match(name.removeprefix("import "))]
    status = _statuses([name for _, name in rows])
    shared = {name: status[name] for n, name in rows if n >= 2 and status[name] != "provided"}
    assert shared == {}, shared
    provided = sum(n for n, name in rows if status[name] == "provided")
    total = sum(n for n, _ in rows)
    missing = {name: s for _, name in rows if (s := status[name]) != "provided"}
    assert provided / total >= 0.90, (f"{provided}/{total}", missing)


def test_every_deepspeed_name_the_installed_libraries_reference_resolves():
    """transformers, accelerate, peft, TRL and Lightning, walked from their sources: each name that DeepSpeed
    itself resolves, the stand-in resolves (sequence parallelism's names import and are not built yet)."""
    names = set()
    for package in ("transformers", "accelerate", "peft", "trl", "lightning"):
        names |= stand_in_names.library_names(package)
    assert len(names) > 20, names
    ours = _statuses(sorted(names))
    theirs = {}
    if __import__("importlib.util").util.find_spec("deepspeed") is not None:
        done = subprocess.run([sys.executable, str(TESTS / "stand_in_names.py")], input="\n".join(sorted(names)),
                              capture_output=True, text=True, env=_env(DS_ACCELERATOR="cpu"), timeout=600)
        theirs = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
    wrong = {n: s for n, s in ours.items() if s.startswith("missing") and theirs.get(n, "provided") == "provided"}
    assert wrong == {}, wrong


_LIGHTNING = """
import torch, lightning as L
import deepspeed
class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 1)
    def training_step(self, b, i):
        return self.l(b).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
try:
    L.Trainer(accelerator="cpu", devices=1, strategy="deepspeed_stage_2_offload", max_steps=1, logger=False,
              enable_checkpointing=False).fit(M(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
except RuntimeError as e:
    print("refused:", e)
"""


def test_lightning_deepspeed_strategies_answer_on_the_cpu_as_under_deepspeed():
    """Lightning finds the stand-in (its requirement check reads the distribution) and builds its DeepSpeed strategy;
    on a CPU accelerator it then refuses, as it does with DeepSpeed itself: Lightning runs them on CUDA only."""
    pytest.importorskip("lightning")
    ours = _python(_LIGHTNING, _env(**ON))
    assert "refused: The DeepSpeed strategy is only supported on CUDA GPUs" in ours.stdout, ours.stderr[-2000:]
    if __import__("importlib.util").util.find_spec("deepspeed") is not None:
        theirs = _python(_LIGHTNING, _env(DS_ACCELERATOR="cpu"))
        assert theirs.stdout.strip().splitlines()[-1] == ours.stdout.strip().splitlines()[-1], theirs.stderr[-2000:]
