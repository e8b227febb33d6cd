"""Random block-wise fp8 problems (1x128 activation groups, 128x128 weight blocks) and their
float64 oracle, computed from the dequantized operands (not from the op's per-group form)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.support.helpers import random_q, scale

BLOCK = 128


def blocks(n: int) -> int:
    return -(-n // BLOCK)


@dataclass
class BlockProblem:
    a: torch.Tensor  # [M, K] fp8
    b: torch.Tensor  # [K, N] fp8: w.t() of a row-major [N, K] weight
    scale_a: torch.Tensor  # [M, ceil(K/128)]
    scale_b: torch.Tensor  # [ceil(K/128), ceil(N/128)]: w_scale.t() of the weight's [N/128, K/128] scales
    bias: torch.Tensor | None = None

    def args(self, out_dtype):
        return self.a, self.b, self.scale_a, self.scale_b, out_dtype, self.bias


def make_block_problem(M, N, K, *, bias_dtype=None, m_major=False, device="cpu", seed=0) -> BlockProblem:
    """A random problem laid out as users pass it: ``b = w.t()``, ``scale_b = w_scale.t()``;
    ``m_major``: ``scale_a`` with stride (1, M), as cuBLAS takes it."""
    g = torch.Generator().manual_seed(seed)
    a = random_q((M, K), torch.float8_e4m3fn, device, g)
    w = random_q((N, K), torch.float8_e4m3fn, device, g)
    sa = scale((M, blocks(K)), device, g)
    if m_major:
        sa = sa.t().contiguous().t()
    p = BlockProblem(a, w.t(), sa, scale((blocks(N), blocks(K)), device, g).t())
    if bias_dtype is not None:
        p.bias = torch.randn(N, generator=g).to(bias_dtype).to(device)
    return p


def expand_scales(p: BlockProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales spread over every element: [M, K] and [K, N], float64."""
    K, N = p.a.shape[1], p.b.shape[1]
    sa = p.scale_a.double().repeat_interleave(BLOCK, 1)[:, :K]
    sb = p.scale_b.double().repeat_interleave(BLOCK, 0)[:K].repeat_interleave(BLOCK, 1)[:, :N]
    return sa, sb


def block_oracle(p: BlockProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, magnitude) in float64: ``(a * S_a) @ (b * S_b) + bias``, and the same of |terms|
    (the scale of fp32 rounding errors). fp8 x fp32 products are exact in float64."""
    sa, sb = expand_scales(p)
    a, b = p.a.double(), p.b.double()
    out, mag = (a * sa) @ (b * sb), (a.abs() * sa) @ (b.abs() * sb)
    if p.bias is not None:
        out, mag = out + p.bias.double(), mag + p.bias.double().abs()
    return out, mag
