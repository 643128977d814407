"""Muon's native partition passes (`zero_offload.optim.muon_pass`) are torch's ops (`momentum_step`, ``mul_``,
``add_``) bitwise: the same formulas, with multiply-adds fused where torch's kernels fuse them (its AVX2/AVX-512
capability) and not under its portable one; without the library, torch's ops themselves."""
import os
import subprocess
import sys

import pytest
import torch

from zero_offload.optim import _native
from zero_offload.optim import muon_pass
from zero_offload.optim.muon import MuonRule, momentum_step
from zero_offload.optim.muon_pass import momentum_pass, update_pass

SIZES = (200_003, 17)          # several of the kernel's blocks with a tail; less than one of torch's vectors
native = pytest.mark.skipif(_native.load() is None, reason="the native library is not built")


def _torch_momentum(momentum, grad, scale, rule):
    return momentum_step(momentum, grad.float().mul_(scale), rule)


def _check_bitwise() -> None:
    for n in SIZES:
        gen = torch.Generator().manual_seed(n)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for beta, nesterov in ((0.95, True), (0.9, False), (0.3, True)):
                rule = MuonRule(momentum=beta, nesterov=nesterov)
                grad = torch.randn(n, generator=gen).to(dtype)
                start = torch.randn(n, generator=gen)
                mine, theirs = start.clone(), start.clone()
                out = torch.empty(n)
                assert momentum_pass(mine, grad, 0.37, rule, out=out) is out
                assert torch.equal(out, _torch_momentum(theirs, grad, 0.37, rule))
                assert torch.equal(mine, theirs) and not torch.equal(mine, start), (n, dtype, beta)
        master, result = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        mine, theirs = master.clone(), master.clone()
        update_pass(mine, result, 0.02, 0.1, 1.3)
        assert torch.equal(mine, theirs.mul_(1 - 0.02 * 0.1).add_(result, alpha=-0.02 * 1.3))


@native
def test_native_passes_are_torch_bitwise():
    _check_bitwise()


@native
def test_native_passes_follow_torchs_portable_kernels():
    """Under ``ATEN_CPU_CAPABILITY=default`` torch does not fuse; the passes follow (a process of its own: torch reads
    the variable once)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    code = ("import torch, test_muon_pass as t; assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'; "
            "t._check_bitwise()")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(__file__))


def test_without_the_library_the_passes_are_torch(monkeypatch):
    monkeypatch.setattr(muon_pass._native, "load", lambda: None)
    _check_bitwise()
