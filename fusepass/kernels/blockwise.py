"""The block-wise scaled fp8 GEMM (DeepSeek-V3's recipe): float8_e4m3fn operands with one fp32
scale per 1x128 group of ``a`` (a row, 128 of K) and one per 128x128 block of ``b``, applied in
the main loop, then the bias and the cast in registers and one write of the output.

    out[m, n] = sum_g scale_a[m, g] * scale_b[g, n // 128] * (a[m, K_g] @ b[K_g, n]) + bias[n]

with ``K_g`` the g-th 128-wide group of K. The scales change from one group to the next, so
they cannot wait for the epilogue: each group is summed into an fp32 partial (``GROUP_K //
BLOCK_K`` dots; BLOCK_K divides 128), which is scaled by ``scale_a[:, g] x scale_b[g, :]`` and
added to the fp32 accumulator one group late: group g's dots are issued before group g-1's
partial is scaled, so the MMAs need not wait for each scaling (1.03-1.27x faster at M >= 256,
1.06-1.21x at M <= 64, H200). Hopper's fp8 MMAs add at reduced
precision, so the partial is promoted to fp32 every BLOCK_K (``max_num_imprecise_acc``), as
in ``scaled_mm.py``.

``SPLIT_K`` > 1 splits the K groups over programs along grid axis 1 (decode at a small N has
too few N tiles to keep every SM reading): each publishes its fp32 sum, already scaled, and
the last of a tile's programs adds the slices in a fixed order, adds the bias and casts
(``scaled_mm.split_k_sum``: one launch).

Pointer loads only (no TMA): row/column offsets are 64-bit, ragged M and N
wrap around (in-bounds loads, results masked at the store), and a ragged K (``EVEN_K`` off:
K not a multiple of 128) is masked with zeros, so the last group's missing products add 0.
Any strides for ``a``, ``b`` and both scales (an M-major ``scale_a`` as cuBLAS takes it, a
transposed ``scale_b`` view as vLLM passes it).

``blockwise_launch.py`` chooses the configuration and launches this kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scaled_mm import grouped_tile, k_slice, split_k_sum

# The DeepSeek-V3 recipe, as torch._scaled_mm, cuBLAS and vLLM's CUTLASS kernels take it: one
# activation scale per 1x128 group (a row, 128 of K), one weight scale per 128x128 block.
BLOCK = 128


@triton.jit
def blockwise_mm_kernel(
    # Operands
    a_ptr, b_ptr, out_ptr,  # (M, K), (K, N), (M, N); a and b float8_e4m3fn
    scale_a_ptr, scale_b_ptr,  # (M, ceil(K/128)), (ceil(K/128), ceil(N/128)); fp32
    bias_ptr,  # (N,); None when unused
    partial_ptr,  # (SPLIT_K, M, N) fp32 when SPLIT_K > 1; None otherwise
    tickets_ptr,  # (tiles,) int32 zeros when SPLIT_K > 1; None otherwise
    # Sizes
    M, N, K,
    # Strides (any layout)
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_om, stride_on,
    stride_sam, stride_sag,  # scale_a: per row, per K group
    stride_sbg, stride_sbn,  # scale_b: per K group, per N block
    # Epilogue variant
    HAS_BIAS: tl.constexpr,
    # Tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K divides GROUP_K
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K, each a run of whole K groups
    GROUP_K: tl.constexpr,  # 128: the scale block along K and N
    EVEN_K: tl.constexpr,  # K % GROUP_K == 0: no mask on the loads
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # 64-bit row/column indices; rows/columns past the edge wrap around to valid ones.
    offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # (BLOCK_M,)
    offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # (BLOCK_K,)
    g_first, g_end = k_slice(K, GROUP_K, SPLIT_K)  # this program's K groups
    k_first = g_first.to(tl.int64) * GROUP_K
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_first + offs_k[None, :]) * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + (k_first + offs_k[:, None]) * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    step_a = tl.cast(stride_ak, tl.int64) * BLOCK_K
    step_b = tl.cast(stride_bk, tl.int64) * BLOCK_K
    # The scales of the first K group: a column of scale_a, and scale_b's value for this tile's
    # N block (a BLOCK_N dividing 128 keeps a tile inside one block: one scalar, 1.05-1.16x
    # faster than a vector with 64x128 tiles at M >= 1024 on an H200) or, for
    # a wider tile, one value per column.
    step_sa = tl.cast(stride_sag, tl.int64)
    step_sb = tl.cast(stride_sbg, tl.int64)
    sa_ptrs = scale_a_ptr + offs_m * stride_sam + g_first * step_sa  # (BLOCK_M,)
    if BLOCK_N <= GROUP_K:
        sb_ptrs = scale_b_ptr + (pid_n * BLOCK_N // GROUP_K) * stride_sbn + g_first * step_sb  # scalar
    else:
        sb_ptrs = scale_b_ptr + (offs_n // GROUP_K) * stride_sbn + g_first * step_sb  # (BLOCK_N,)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The previous group's partial and its scales, added to acc once this group's dots are
    # issued (see the module docstring: one group late).
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev_s = tl.zeros((BLOCK_M, 1 if BLOCK_N <= GROUP_K else BLOCK_N), dtype=tl.float32)
    for g in range(g_first, g_end):
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(GROUP_K // BLOCK_K):
            if EVEN_K:
                a_tile = tl.load(a_ptrs)
                b_tile = tl.load(b_ptrs)
            else:
                k_left = K - (g * GROUP_K + s * BLOCK_K)
                # other=0.0: the interpreter needs a float fill for fp8.
                a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            part = tl.dot(a_tile, b_tile, part, max_num_imprecise_acc=BLOCK_K)
            a_ptrs += step_a
            b_ptrs += step_b
        acc += prev * prev_s
        sa = tl.load(sa_ptrs)  # (BLOCK_M,)
        sb = tl.load(sb_ptrs)  # scalar or (BLOCK_N,)
        if BLOCK_N <= GROUP_K:
            prev_s = (sa * sb)[:, None]
        else:
            prev_s = sa[:, None] * sb[None, :]
        prev = part
        sa_ptrs += step_sa
        sb_ptrs += step_sb
    acc += prev * prev_s

    # Store with unwrapped indices so the wrapped (duplicate) rows/columns are masked off.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    last = True
    if SPLIT_K > 1:
        last, acc = split_k_sum(acc, partial_ptr, tickets_ptr, rows, cols, mask, M, N, SPLIT_K)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
