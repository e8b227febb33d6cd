"""Float rows quantized per row: ``quantize_rows_kernel``.

    q[m], scale[m] = quantize_rows(x[m])            (``ops.dynamic.quantize_rows``' recipes)
    GATED: q[m], scale[m] = quantize_rows(silu(g[m]) * x[m])

The numbers are the M = 1 kernel's own where it quantizes its row (``gemv.py``: ``_row_block``,
``_quantized``, ``scale_of``): the scale with a correctly rounded division, NaN where the row
holds a NaN or an infinity; the SiLU-mul rounded to ``x``'s dtype after each op, as eager rounds
it; int8 and e4m3 rounded to nearest even. The rows of a mixture of experts between its gate/up
and down GEMMs take it where the sorted blocks run (``grouped_launch.launch_scaled_grouped_mm``
with a recipe, above the row kernel's rows). Its time is its arithmetic, not its bytes (the
SiLU's exp and the correctly rounded divisions): hence each row computed once, every lane on
a value (docs/PERFORMANCE.md, "Mixture of experts": "The SiLU-mul and quantization").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _quantized, _row_block, row_scale, scale_of


@triton.jit
def quantize_rows_kernel(
    x_ptr, g_ptr, q_ptr, scale_ptr,  # (M, K) any strides; GATED (M, K) of x's strides; (M, K) contiguous; (M,)
    M, K, stride_xm, stride_xk,
    DIVISOR: tl.constexpr, FLOOR: tl.constexpr, FLOOR_FIRST: tl.constexpr, GATED: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PIECES: tl.constexpr,  # > 0: a row is PIECES pieces of BLOCK_K (the last masked unless EVEN_K); 0: a row a program
    SLOTS: tl.constexpr,  # PIECES > 0: a power of two >= PIECES, the pieces a program holds
):
    """Where PIECES > 0 (K up to ``grouped_launch.QUANTIZE_BLOCK_K``) a program holds
    SLOTS // PIECES rows in registers as SLOTS pieces of BLOCK_K (a piece whose row is past them
    unused; a ragged last program reads row M - 1 again, its stores masked), each row read and
    computed once: a row of 768 as 3 pieces of 256, 5 rows in 16 slots, where one block of 1024
    a row left a quarter of the lanes idle. Else a row a program, read twice: its amax, then its
    values."""
    fp8: tl.constexpr = q_ptr.dtype.element_ty == tl.float8e4nv
    if PIECES > 0:
        ROWS: tl.constexpr = SLOTS // PIECES
        slot = tl.arange(0, SLOTS)
        offs_m = tl.program_id(0).to(tl.int64) * ROWS + slot // PIECES  # (SLOTS,) each piece's row
        rows = tl.minimum(offs_m, M - 1)[:, None]
        offs_k = (slot % PIECES * BLOCK_K)[:, None] + tl.arange(0, BLOCK_K)[None, :]  # (SLOTS, BLOCK_K)
        row_ptr, gate_ptr = x_ptr + rows * stride_xm, g_ptr
        if GATED:
            gate_ptr = g_ptr + rows * stride_xm
        x = _row_block(row_ptr, gate_ptr, offs_k, K, stride_xk, EVEN_K, GATED).to(tl.float32)
        # (a piece's amax and NaN test: gemv.row_scale's, a piece at a time)
        amax, nans = tl.max(tl.abs(x), axis=1), tl.sum(x * 0.0, axis=1)  # (SLOTS,)
        if PIECES > 1:  # (its row's: the row's pieces combined, slot j standing for the program's row j)
            mine = (slot // PIECES)[None, :] == slot[:, None]  # (row j, piece i)
            amax = tl.max(tl.where(mine, amax[None, :], 0.0), axis=1)
            nans = tl.sum(tl.where(mine, nans[None, :], 0.0), axis=1)
        scale = scale_of(amax, nans, DIVISOR, FLOOR, FLOOR_FIRST)  # (SLOTS,) of the program's rows j
        piece_scale = scale
        if PIECES > 1:
            piece_scale = tl.sum(tl.where(mine, scale[:, None], 0.0), axis=0)
        q = _quantized(x, piece_scale[:, None], fp8)
        used = (slot < ROWS * PIECES) & (offs_m < M)
        tl.store(q_ptr + offs_m[:, None] * K + offs_k, q.to(q_ptr.dtype.element_ty),
                 mask=used[:, None] & (offs_k < K))
        offs_m = tl.program_id(0).to(tl.int64) * ROWS + slot
        tl.store(scale_ptr + offs_m, scale, mask=(slot < ROWS) & (offs_m < M))
    else:
        m = tl.program_id(0).to(tl.int64)
        row_ptr, gate_ptr = x_ptr + m * stride_xm, g_ptr
        if GATED:
            gate_ptr = g_ptr + m * stride_xm
        scale = row_scale(row_ptr, gate_ptr, K, stride_xk, DIVISOR, FLOOR, BLOCK_K, EVEN_K, GATED, FLOOR_FIRST)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            q = _quantized(_row_block(row_ptr, gate_ptr, offs_k, K, stride_xk, EVEN_K, GATED), scale, fp8)
            tl.store(q_ptr + m * K + offs_k, q.to(q_ptr.dtype.element_ty), mask=offs_k < K)
        tl.store(scale_ptr + m, scale)
