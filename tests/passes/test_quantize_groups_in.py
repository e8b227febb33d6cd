"""``quantized_groups_in_gemv``: at M = 1, a prepared fp8-block linear's 1x128-group
quantization moves into ``fusepass.scaled_mm_blockwise_dynamic`` (``passes/quantize_in.py``),
in CUDA graphs and out; elsewhere, and where the form differs, the calls stay."""

from __future__ import annotations

import pytest
import torch

from fusepass.integrations.linear import Act, Joint, W8A8Linear
from fusepass.passes import PassConfig
from fusepass.passes.quantize_in import GROUPS_NAME
from tests.passes.harness import run_pass

F8 = torch.float8_e4m3fn


def _linear(n=256, k=384, seed=0, floor=None, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(F8)
    act = Act("fp8-block") if floor is None else Act("fp8-block", floor=floor)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return W8A8Linear(Joint(w, torch.rand(n // 128, k // 128, generator=g) / 100, None, b), 0, n, act)


def _norm_then(linear):
    def fn(x):
        return linear(x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype))
    return fn


@pytest.mark.parametrize("bias", [False, True])
def test_m1_group_quantization_moves_into_the_op(bias):
    lin = _linear(bias=bias)
    x = torch.randn(1, 1, 384, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    on = run_pass(_norm_then(lin), x)
    assert on.counts.get(GROUPS_NAME) == 1  # (counters are the process's: read before the next run)
    off = run_pass(_norm_then(lin), x, config=PassConfig(quantize_groups_in_gemv=False))
    assert GROUPS_NAME not in off.counts
    assert "fusepass.scaled_mm_blockwise_dynamic(" in on.after and "amax" not in on.after, on.after
    assert "fusepass.scaled_mm_blockwise(" in off.after
    # the same quantization (IEEE divisions: the CPU's ATen ops alike), the same product
    torch.testing.assert_close(on.out, off.out, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(on.out, lin(x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
                                              .to(x.dtype)), rtol=1e-2, atol=1e-2)


def test_not_above_m1():
    lin = _linear()
    x = torch.randn(1, 2, 384, dtype=torch.bfloat16)
    assert GROUPS_NAME not in run_pass(_norm_then(lin), x).counts


def test_not_where_the_quantization_has_another_user():
    """The row's quantized values read twice (by the matmul and by the output): they stay."""
    lin = _linear()

    def fn(x):
        from fusepass.ops.blockwise import quantize_groups
        q, s = quantize_groups(x.reshape(1, 384), 1e-6)
        y = torch.ops.fusepass.scaled_mm_blockwise(q, lin.joint.weight.t(), s, lin.joint.weight_scale.t(),
                                                   torch.bfloat16)
        return y, q.float().sum()
    result = run_pass(fn, torch.randn(1, 384, dtype=torch.bfloat16))
    assert GROUPS_NAME not in result.counts


def test_in_cuda_graphs_too():
    """Unlike ``quantize_in_gemv``, also where the launches run inside CUDA graphs (a group's
    scale needs no read of the row first: ``PassConfig.quantize_groups_in_gemv``)."""
    lin = _linear()
    x = torch.randn(1, 1, 384, dtype=torch.bfloat16)
    inside = PassConfig(split_k_outside_cuda_graphs=True)  # (the config's word for "in CUDA graphs")
    assert run_pass(_norm_then(lin), x, config=inside).counts.get(GROUPS_NAME) == 1
