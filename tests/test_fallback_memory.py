"""The torch fallback of the host Adam step (no native kernel, ``ZERO_OFFLOAD_NO_NATIVE=1``) works chunk by chunk
like the kernel: its extra memory is a few chunks, not fp32 temporaries the size of the partition (issue 20,
section 1: several of them, ~200 GB at 10B parameters). Measured as peak RssAnon growth in a fresh process
(`memory_probe`), directly and under the delayed parameter update."""
import pytest

from memory_probe import run_fresh

NUMEL = 32 * 2**20                   # 128 MiB of fp32: a partition-sized temporary cannot hide in the bound
CHUNK_BYTES = 4 * 2**21              # one fp32 chunk of fused_adam.DEFAULT_CHUNK elements (8 MiB)
BOUND = 5 * CHUNK_BYTES              # 4 chunks of scratch at most, and slack; the partition is 16 chunks

STEP = r'''
import json, os, sys, warnings
os.environ["ZERO_OFFLOAD_NO_NATIVE"] = "1"
sys.path.insert(0, sys.argv[-1])
warnings.simplefilter("ignore")
import torch
from memory_probe import peak_during
from zero_offload.optim.fused_adam import DEFAULT_CHUNK, fused_adam_step, native_available
n, state = int(sys.argv[1]), getattr(torch, sys.argv[2])
assert not native_available()
g = torch.Generator().manual_seed(0)
master = torch.randn(n, generator=g)
grad = torch.randn(n, generator=g).to(torch.bfloat16)
m, v = torch.zeros(n, dtype=state), torch.zeros(n, dtype=state)
out = torch.empty(n, dtype=torch.bfloat16).fill_(0)
kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=0.5, out=out)
small = [t[:1000] for t in (master, grad, m, v, out)]
fused_adam_step(*small[:4], step=1, **{**kw, "out": small[4]})         # torch's kernels loaded first
peak = max(peak_during(lambda: fused_adam_step(master, grad, m, v, step=s, **kw)) for s in (1, 2))
print(json.dumps({"peak": peak, "chunk": DEFAULT_CHUNK}))
'''


@pytest.mark.parametrize("state", ["float32", "bfloat16"])   # torch's fused AdamW; its ops in AdamW's order
def test_fallback_step_memory_is_a_few_chunks(state):
    out = run_fresh(STEP, NUMEL, state)
    assert out["chunk"] * 4 == CHUNK_BYTES
    assert out["peak"] <= BOUND, f"fallback grew RssAnon by {out['peak'] / 2**20:.0f} MiB on a 128 MiB partition"


DPU = r'''
import json, os, sys, warnings
os.environ["ZERO_OFFLOAD_NO_NATIVE"] = "1"
sys.path.insert(0, sys.argv[-1])
warnings.simplefilter("ignore")
import torch
import zero_offload
from memory_probe import OneVector, peak_during
n = int(sys.argv[1])
torch.manual_seed(0)
cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1e-3, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": True,
                                                               "dpu_warmup_steps": 1}}}
engine = zero_offload.initialize(OneVector(n), cfg)
x = torch.randn(16)
def backward():
    engine.backward(engine(x))
for _ in range(2):    # the warm-up step (synchronous; the moments are allocated) and the first delayed one
    backward()
    engine.step()
backward()
# The step launches the host step in the background; the flush waits for it and copies its parameters up.
peak = peak_during(lambda: (engine.step(), engine.flush_delayed_update()))
print(json.dumps({"peak": peak, "global_step": engine.global_step}))
'''


def test_fallback_memory_under_delayed_update():
    out = run_fresh(DPU, NUMEL)
    assert out["global_step"] == 3
    assert out["peak"] <= BOUND, f"delayed step grew RssAnon by {out['peak'] / 2**20:.0f} MiB (128 MiB partition)"
