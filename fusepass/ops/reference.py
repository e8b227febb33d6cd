"""Plain-torch reference of the fused epilogue: the CPU implementation of every op.

    out = scale_a * scale_b * (acc - azp * azp_adj) + bias,    acc = a @ b

int8: ``acc`` is accumulated exactly in int32, and an int32 zero-point correction is
applied in int32 too (exact, like the kernel). fp8: ``acc`` is fp32. The epilogue then
runs in fp32 and rounds once to ``out_dtype``, in the same order as the Triton kernel.

Block-wise fp8 (``scaled_mm_blockwise``): the scales change along K, so they are applied
per 128-wide group of K, to that group's fp32 sum, before the groups are added.
"""

from __future__ import annotations

import torch

from ..kernels.grouped_launch import route_blocks
from ..kernels.scaled_mm import COLSUM_MAX, PER_TENSOR_ADJ_MAX, ZERO_POINT_MAX
from .checks import BLOCK


def accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the accumulator dtype: int32 (exact) for int8, fp32 for fp8."""
    if a.dtype == torch.int8:
        return a.to(torch.int32) @ b.to(torch.int32)
    return a.to(torch.float32) @ b.to(torch.float32)


def zero_point_correction(
    acc: torch.Tensor, azp_adj: torch.Tensor, azp: torch.Tensor | None
) -> torch.Tensor:
    """``acc - azp_adj`` (per-tensor) or ``acc - azp[:, None] * azp_adj`` (per-token).

    Integer operands keep it integer and exact (int64 here; the kernel's int32 gives the same
    within ``refused_zero_points``' bounds, its int64 the same always); a float32 operand makes
    it fp32 (the kernel's promotion rule).
    """
    adj = azp_adj.reshape(1, -1)
    if azp is not None:
        adj = azp.reshape(-1, 1) * adj if adj.dtype.is_floating_point or azp.dtype.is_floating_point \
            else azp.reshape(-1, 1).long() * adj.long()
    if adj.dtype.is_floating_point:
        return acc.to(torch.float32) - adj
    return acc.long() - adj.long()


def refused_zero_points(azp_adj: torch.Tensor, azp: torch.Tensor | None) -> torch.Tensor | None:
    """Where int32 zero-point terms pass the bounds int8 quantization keeps them in
    (``kernels/scaled_mm.py``: with them the kernel's int32 sum is exact): a boolean mask
    broadcasting to the output, whose outputs are NaN; None where a term is fp32 or int64 (the
    kernel's sum is then fp32, or int64 and exact)."""
    if azp_adj.dtype != torch.int32 or (azp is not None and azp.dtype != torch.int32):
        return None
    def beyond(t, bound):  # (not abs(): int32's lowest value is its own absolute value)
        return (t > bound) | (t < -bound)
    if azp is None:
        return beyond(azp_adj.reshape(1, -1), PER_TENSOR_ADJ_MAX)
    return beyond(azp.reshape(-1, 1), ZERO_POINT_MAX) | beyond(azp_adj.reshape(1, -1), COLSUM_MAX)


def epilogue(
    acc: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Scale rows and columns of the accumulator, add bias, round once to ``out_dtype``. The
    two scales are multiplied first (the kernel's order): their product is the value's own
    scale, where ``acc * scale_a`` alone can pass fp32's range (1e36 and 1e-20 gave -inf where
    the value was -5e20)."""
    x = acc.to(torch.float32)
    scale_a, scale_b = scale_a.to(torch.float32), scale_b.to(torch.float32)  # (bf16 / fp16: exact)
    return add_bias_and_round(x * (scale_a.reshape(-1, 1) * scale_b.reshape(1, -1)), out_dtype, bias)


def add_bias_and_round(x: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """The end of every epilogue: ``+ bias`` in fp32, one rounding to ``out_dtype``."""
    if bias is not None:
        x = x + bias.to(torch.float32)
    return x.to(out_dtype).contiguous()


def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None):
    return epilogue(accumulate(a, b), scale_a, scale_b, out_dtype, bias)


def scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    acc = zero_point_correction(accumulate(a, b), azp_adj, azp)
    refused = refused_zero_points(azp_adj, azp)
    if refused is not None:
        acc = acc.to(torch.float32).masked_fill(refused, float("nan"))
    return epilogue(acc, scale_a, scale_b, out_dtype, bias)


def accumulate_blockwise(a, b, scale_a, scale_b) -> torch.Tensor:
    """``sum_g scale_a[:, g] * scale_b[g, n // 128] * (a[:, K_g] @ b[K_g, :])`` in fp32, with
    ``K_g`` the g-th 128-wide group of K (the last one ragged): each group's products summed in
    fp32, scaled, and added to the accumulator in group order (what the kernel does). One group
    at a time, so the memory is one [M, N] partial whatever K: this is also what a compiled CPU
    graph runs (``passes/lower.py``), one ``mm`` per group."""
    K, N = b.shape
    sb = scale_b.repeat_interleave(BLOCK, dim=1)[:, :N]  # [groups, N]: one value per column
    acc = None
    for g in range(scale_a.shape[1]):
        k = slice(g * BLOCK, min(K, (g + 1) * BLOCK))
        part = (a[:, k].to(torch.float32) @ b[k].to(torch.float32)) * scale_a[:, g, None] * sb[g]
        acc = part if acc is None else acc + part
    return acc if acc is not None else a.new_zeros((a.shape[0], N), dtype=torch.float32)  # K = 0


def scaled_mm_blockwise(a, b, scale_a, scale_b, out_dtype, bias=None):
    return add_bias_and_round(accumulate_blockwise(a, b, scale_a, scale_b), out_dtype, bias)


def route_experts(expert_ids, E: int, block_m: int):
    """``kernels.grouped_launch.route``'s (rows, block_experts) in torch ops, int32: a stable
    sort of the rows by expert (ids outside [0, E) as group E), each group padded to whole blocks
    with the row M, the list padded to its fixed length; each block's group, E + 1 past the groups."""
    M, device = expert_ids.shape[0], expert_ids.device
    ids = expert_ids.to(torch.int64)
    key = torch.where((ids >= 0) & (ids < E), ids, E)  # groups 0..E: E collects invalid ids
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    group = key[order]
    rank = torch.arange(M, device=device) - (torch.cumsum(counts, 0) - counts)[group]
    blocks = route_blocks(M, E, block_m)
    rows = torch.full((blocks * block_m,), M, dtype=torch.int64, device=device)
    rows = rows.scatter(0, (pad_end - padded)[group] + rank, order)
    block_experts = torch.searchsorted(pad_end, torch.arange(blocks, device=device) * block_m, right=True)
    return rows.to(torch.int32), block_experts.to(torch.int32)


def scaled_grouped_mm(a, b, scale_a, scale_b, expert_ids, out_dtype, bias=None, row_weights=None):
    """Each row's product with its expert's weight, in the accumulator dtype, then the epilogue
    of its expert's scales and bias and its row weight in fp32, one rounding (block scales: each
    1x128 group's product scaled in fp32 as it is summed, as ``scaled_mm_blockwise``'s); a row whose expert
    id is outside [0, E) is NaN. Every row's product with each expert in turn, kept where the row
    is that expert's: exact sums, and no data-dependent shape (a compiled CPU graph traces this)."""
    M, N, E = expert_ids.shape[0], b.shape[2], b.shape[0]
    if a.shape[0] != M:  # (each row of ``a`` shared by M / T consecutive routed rows)
        share = M // a.shape[0]
        a = a.repeat_interleave(share, 0)
        scale_a = scale_a.repeat_interleave(share, 0) if scale_a.numel() > 1 else scale_a
    x = torch.full((M, N), float("nan"), dtype=torch.float32, device=a.device)
    blocks = scale_b.dim() == 3  # (per 1x128 group of a row, per 128x128 block of an expert)
    sa = scale_a.to(torch.float32) if blocks else scale_a.to(torch.float32).reshape(-1, 1)
    sb = scale_b.to(torch.float32) if blocks else scale_b.to(torch.float32).reshape(E, -1)
    ids = expert_ids.reshape(-1, 1)
    for e in range(E):
        if blocks:
            y = accumulate_blockwise(a, b[e], sa, sb[e])
        else:
            y = accumulate(a, b[e]).to(torch.float32) * (sa * sb[e].reshape(1, -1))
        if bias is not None:
            y = y + bias[e].to(torch.float32)
        x = torch.where(ids == e, y, x)
    if row_weights is not None:
        x = x * row_weights.to(torch.float32).reshape(-1, 1)
    return x.to(out_dtype).contiguous()
