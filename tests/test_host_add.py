"""The staged gradient add (issue 27, item 4; `zero_offload.optim.host_add`): the native kernel writes what torch's
``dst.add_(src)`` / ``dst.copy_(src)`` writes, bitwise, and the sum of squares of the result, against torch."""
from __future__ import annotations

import pytest
import torch

from zero_offload.optim import _native, host_add

needs_native = pytest.mark.skipif(_native.load() is None, reason="the native host kernel is not built")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("n,threads", [(1, 1), (1000, 3), (200_003, 1), (200_003, 3)])
def test_the_kernel_matches_torch(dtype, overwrite, n, threads):
    g = torch.Generator().manual_seed(n + threads)
    base = torch.randn(n, generator=g) * 3
    src = (torch.randn(n, generator=g) * 100).to(dtype)
    ours, ref = base.clone(), base.clone()
    sq = host_add.accumulate(ours, src, overwrite, threads)
    ref.copy_(src) if overwrite else ref.add_(src)
    assert torch.equal(ours, ref)
    want = ref.double().square().sum()
    assert sq.dtype == torch.float32 and sq.dim() == 0
    assert abs(sq.double() - want) <= 1e-6 * want, (float(sq), float(want))


def test_without_the_kernel_torch_does_it(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda *a, **k: None)
    dst, src = torch.ones(10), torch.full((10,), 2.0, dtype=torch.bfloat16)
    total = float(host_add.accumulate(dst, src, False, 2))
    assert abs(total - 90.0) < 1e-4 and torch.equal(dst, torch.full((10,), 3.0))


@pytest.mark.parametrize("dst,src,threads,fault", [
    (torch.zeros(4, dtype=torch.float16), torch.zeros(4), 1, "dst must be"),
    (torch.zeros(4), torch.zeros(4, dtype=torch.int32), 1, "src must be"),
    (torch.zeros(4), torch.zeros(2, 2), 1, "src must be"),
    (torch.zeros(4), torch.zeros(5), 1, "src has 5 elements, dst has 4"),
    (torch.zeros(4), torch.zeros(4), 0, "threads must be >= 1"),
])
def test_bad_arguments_are_refused_by_name(dst, src, threads, fault):
    with pytest.raises(ValueError, match=fault):
        host_add.accumulate(dst, src, False, threads)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_bf16_partition_adds_round_each_sum_to_nearest(src_dtype):
    """A bf16 gradient partition (``bf16_master_weights_and_grads``): each add is the fp32 sum rounded to bf16, and
    the squares are those of the rounded result."""
    g = torch.Generator().manual_seed(3)
    dst = torch.randn(1000, generator=g).to(torch.bfloat16)
    src = (torch.randn(1000, generator=g) * 1e-2).to(src_dtype)
    expect = (dst.float() + src.float()).to(torch.bfloat16)
    sq = host_add.accumulate(dst, src, False, 2)
    assert torch.equal(dst, expect)
    assert torch.allclose(sq, expect.float().square().sum(), rtol=1e-6)
