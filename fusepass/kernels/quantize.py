"""Float rows quantized per row, a program a row: ``quantize_rows_kernel``.

    q[m], scale[m] = quantize_rows(x[m])            (``ops.dynamic.quantize_rows``' recipes)
    GATED: q[m], scale[m] = quantize_rows(silu(g[m]) * x[m])

The numbers are the M = 1 kernel's own where it quantizes its row (``gemv.py``: ``row_scale``,
``_row_block``, ``_quantized``): the scale with a correctly rounded division, NaN where the row
holds a NaN or an infinity; the SiLU-mul rounded to ``x``'s dtype after each op, as eager rounds
it; int8 and e4m3 rounded to nearest even. The rows of a mixture of experts between its gate/up
and down GEMMs take it where the sorted blocks run (``grouped_launch.launch_scaled_grouped_mm``
with a recipe, above the row kernel's rows): Inductor's kernel for the same graph, a looped
reduction, read them at 1.7 TB/s at prefill (docs/PERFORMANCE.md, "Mixture of experts").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _quantized, _row_block, row_scale


@triton.jit
def quantize_rows_kernel(
    x_ptr, g_ptr, q_ptr, scale_ptr,  # (M, K) any strides; GATED (M, K) of x's strides; (M, K) contiguous; (M,)
    K, stride_xm, stride_xk,
    DIVISOR: tl.constexpr, FLOOR: tl.constexpr, FLOOR_FIRST: tl.constexpr, GATED: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    row_ptr, gate_ptr = x_ptr + m * stride_xm, g_ptr
    if GATED:
        gate_ptr = g_ptr + m * stride_xm
    # (where K fits one block the second read of the row comes from L1)
    scale = row_scale(row_ptr, gate_ptr, K, stride_xk, DIVISOR, FLOOR, BLOCK_K, EVEN_K, GATED, FLOOR_FIRST)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x = _row_block(row_ptr, gate_ptr, offs_k, K, stride_xk, EVEN_K, GATED)
        q = _quantized(x, scale, q_ptr.dtype.element_ty == tl.float8e4nv)
        tl.store(q_ptr + m * K + offs_k, q.to(q_ptr.dtype.element_ty), mask=offs_k < K)
    tl.store(scale_ptr + m, scale)
