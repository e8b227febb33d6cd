"""Mixture-of-experts problems for ``fusepass.scaled_grouped_mm``: a top-k router's rows (each
token's k distinct experts; with many experts some get no row), the experts' weights stored
[E, N, K] as transformers holds them (``b`` their [E, K, N] transpose), and a float64 oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.support.helpers import random_q, scale

BLOCK = 128


@dataclass
class Grouped:
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    expert_ids: torch.Tensor
    bias: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None

    def args(self, out_dtype=torch.bfloat16) -> tuple:
        return (self.a, self.b, self.scale_a, self.scale_b, self.expert_ids, out_dtype, self.bias, self.row_weights)


def routed(tokens: int, top_k: int, E: int, generator) -> torch.Tensor:
    """[tokens * top_k] expert ids: each token's top_k distinct experts, as a router picks them."""
    return torch.stack([torch.randperm(E, generator=generator)[:top_k] for _ in range(tokens)]).reshape(-1) \
        if tokens else torch.zeros(0, dtype=torch.int64)


def make_grouped(tokens, top_k, E, N, K, dtype=torch.int8, *, device="cpu", seed=0, bias=True, row_weights=True,
                 scale_a_shape=None, scale_b_shape=None, ids_dtype=torch.int64, blocks=False) -> Grouped:
    """``blocks``: fp8 with DeepSeek-V3's scales, [M, ceil(K/128)] and [E, ceil(K/128), ceil(N/128)]
    (the transpose of the stored [E, N/128, K/128], as the experts' weights)."""
    g = torch.Generator().manual_seed(seed)
    M = tokens * top_k
    a = random_q((M, K), dtype, device, g)
    w = random_q((E, N, K), dtype, device, g)  # stored [E, N, K]
    groups, n_blocks = -(-K // BLOCK), -(-N // BLOCK)
    if blocks:
        sa, sb = scale((M, groups), device, g), scale((E, n_blocks, groups), device, g).transpose(1, 2)
    else:
        sa = scale((M,) if scale_a_shape is None else scale_a_shape, device, g)
        sb = scale((E, N) if scale_b_shape is None else scale_b_shape, device, g)
    p = Grouped(a, w.transpose(1, 2), sa, sb, routed(tokens, top_k, E, g).to(ids_dtype).to(device))
    if bias:
        p.bias = torch.randn(E, N, generator=g).to(device)
    if row_weights:
        p.row_weights = torch.rand(M, generator=g).to(device)
    return p


def oracle(p: Grouped) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, magnitude) in float64: every row's exact product with its expert's weight (int8 and
    e4m3 products and their sums are exact in float64 here), scaled, biased, weighted; the
    magnitude bounds the terms summed, for an fp32 rounding allowance. NaN rows where the id is
    outside [0, E)."""
    M, E, N = p.a.shape[0], p.b.shape[0], p.b.shape[2]
    ids = p.expert_ids.long().cpu()
    valid = (ids >= 0) & (ids < E)
    e = ids.clamp(0, E - 1)
    a = p.a.double()
    acc = torch.zeros(M, N, dtype=torch.float64, device=a.device)
    mag = torch.zeros_like(acc)
    blocks = p.scale_b.dim() == 3
    for expert in e.unique().tolist():  # (one expert at a time: no [M, K, N] gather at GPU sizes)
        rows = (e == expert).nonzero().reshape(-1).to(a.device)
        b = p.b[expert].double()
        if blocks:  # each 1x128 group's product scaled by its scales
            sa = p.scale_a[rows].double().repeat_interleave(BLOCK, 1)[:, :b.shape[0]]
            sb = p.scale_b[expert].double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:b.shape[0], :N]
            for g in range(0, b.shape[0], BLOCK):
                k = slice(g, g + BLOCK)
                x, y = a[rows][:, k] * sa[:, k], b[k] * sb[k]
                acc[rows] += x @ y
                mag[rows] += x.abs() @ y.abs()
        else:
            acc[rows], mag[rows] = a[rows] @ b, a[rows].abs() @ b.abs()
    acc, mag = acc.cpu(), mag.cpu()
    if blocks:
        value = acc
    else:
        sa = p.scale_a.cpu().double().reshape(-1, 1).expand(M, 1)
        sb = p.scale_b.cpu().double().reshape(E, -1).expand(E, N)[e]
        mag = mag * sa * sb
        value = acc * sa * sb
    if p.bias is not None:
        bias = p.bias.cpu().double()[e]
        value, mag = value + bias, mag + bias.abs()
    if p.row_weights is not None:
        w = p.row_weights.cpu().double().reshape(-1, 1)
        value, mag = value * w, mag * w.abs()
    value[~valid] = float("nan")
    return value, mag
