"""The op ``fusepass::scaled_mm_blockwise``: an fp8 matmul with block-wise (DeepSeek-V3-style)
scales. With ``K_g`` the g-th 128-wide group of K (the last one ragged), it computes

    out = sum_g scale_a[:, g, None] * scale_b[g, n // 128] * (a[:, K_g] @ b[K_g, :]) + bias

each group summed in fp32, scaled, added into an fp32 accumulator; bias added in fp32 and
the result rounded once to ``out_dtype``.

Arguments (the order of ``scaled_mm``, and of vLLM's ``cutlass_scaled_mm``):

- ``a`` [M, K] and ``b`` [K, N]: float8_e4m3fn, any strides (``b`` is usually ``w.t()`` of a
  row-major [N, K] weight). Any M >= 0; K and N need not be multiples of 128.
- ``scale_a``: fp32 [M, ceil(K/128)], one scale per row and 128-wide group of K (1x128), any
  strides: row-major as a per-token-group quantizer writes it, or M-major (``s.t().contiguous()
  .t()``, stride (1, M)) as cuBLAS's block-wise ``torch._scaled_mm`` and vLLM's CUTLASS take it.
- ``scale_b``: fp32 [ceil(K/128), ceil(N/128)], one scale per 128x128 block of ``b``, any
  strides. Oriented like ``b``: the scales of an [N, K] weight are stored [ceil(N/128),
  ceil(K/128)] (DeepSeek-V3 checkpoints, vLLM's ``weight_scale_inv``), and are passed
  transposed, ``w_scale.t()``, exactly as ``b = w.t()`` (this is what ``torch._scaled_mm`` and
  vLLM's ``cutlass_scaled_mm`` take too). Where ceil(K/128) == ceil(N/128) the shape cannot
  tell a forgotten transpose: the check can only catch it on a non-square block grid.
  cuBLAS's ``torch.nn.functional.scaled_mm`` pads the K blocks of ``scale_b`` to a multiple
  of 4: pass ``scale_b[:ceil(K/128)]``.
- ``out_dtype``: bfloat16, float16 or float32. ``bias``: [N] in one of those dtypes, or None.

Returns a new contiguous [M, N] tensor of ``out_dtype``. Bad input raises before any kernel
runs (``checks.check_scaled_mm_blockwise_args``): ``TypeError`` for a dtype, ``ValueError``
for a shape or device, with what was expected, what was given, and where the given shape is
a known other layout (the transpose of either scale, cuBLAS's padded ``scale_b``, per-token
or per-column scales, another block size), what to pass instead.

Why a sibling op rather than more scale shapes for ``scaled_mm``: a scale's shape alone does
not say its recipe. At K <= 128 a 1x128 ``scale_a`` is [M, 1], a per-token scale's shape; at
M = 1 it is [1, ceil(K/128)], as are 128x128 blocks of ``a`` at any M <= 128 (torch's
``_scaled_mm`` tells them apart by the other operand's scale); with a symbolic M or K, telling
layouts apart would put guards on sizes into the compiled graph. PyTorch itself moved from
shape-inferred recipes (``_scaled_mm``) to explicit ones (``_scaled_mm_v2``). It is also
another kernel (the scales inside the K loop, not in the epilogue) with its own configs, and
``scaled_mm``'s contract, checks and tuned table stay as they are.

Like the other ops, it is a ``torch.library.triton_op``: the implementation below (checks,
then the CPU reference of ``reference.py`` on CPU tensors, or the Triton kernel of
``fusepass.kernels.blockwise`` on CUDA ones) runs eagerly, serves as the fake implementation,
and is what ``fusepass.passes.lower`` inlines into Inductor's graph.

On an sm90 GPU, above 16 rows (``blockwise_launch.CUBLAS_ABOVE_M``), the product runs as
cuBLAS's block-wise ``torch._scaled_mm`` where that call takes the operands and computes them
right (``blockwise_launch.uses_cublas``): M and ceil(K/128) multiples of 4, a row-major ``a``,
a column-major ``b`` (``w.t()``) with 16-byte aligned rows, K and N multiples of 16, no bias
or a bf16 one with a bf16 output, a torch built with CUDA >= 12.9. The scales are copied into
its layout where they are not in it (a row-major ``scale_a``: M * ceil(K/128) floats). The
kernel beats cuBLAS at every measured shape at M = 16, and is slower on average above (0.94x
cuBLAS's speed at M = 64, 0.76x at 256, 0.52-0.85x from 1024 up; H200); cuBLAS's result is
within the same tolerance of the exact product.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels.blockwise_launch import gemv_quantizes_groups, launch_gemv_quantized_groups, launch_scaled_mm_blockwise
from . import reference
from .checks import BLOCK, check_blockwise_dynamic_args, check_scaled_mm_blockwise_args
from .registry import call, define, launch_graphs

Tensor = torch.Tensor
OP = "fusepass.scaled_mm_blockwise"
OP_DYNAMIC = "fusepass.scaled_mm_blockwise_dynamic"


def scaled_mm_blockwise_impl(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
) -> Tensor:
    check_scaled_mm_blockwise_args(OP, a, b, scale_a, scale_b, out_dtype, bias)
    # CPU and meta: the reference; K = 0 anywhere: the empty sum, i.e. the bias alone.
    if a.device.type != "cuda" or statically_known_true(a.shape[1] == 0):
        return reference.scaled_mm_blockwise(a, b, scale_a, scale_b, out_dtype, bias)
    return launch_scaled_mm_blockwise(a, b, scale_a, scale_b, out_dtype, bias, graphs=launch_graphs(a))


def scaled_mm_blockwise_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    check_scaled_mm_blockwise_args(OP, a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


define("scaled_mm_blockwise", scaled_mm_blockwise_impl, scaled_mm_blockwise_fake)


def scaled_mm_blockwise(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor:
    """fp8 matmul with DeepSeek-V3-style block-wise scales, rounded once:
    ``out = sum_g scale_a[:, g] * scale_b[g, n // 128] * (a[:, K_g] @ b[K_g, :]) + bias``.

    a: [M, K] float8_e4m3fn. b: [K, N] float8_e4m3fn, any strides (e.g. ``w.t()``).
    scale_a: fp32 [M, ceil(K/128)] (1x128 groups), any strides. scale_b: fp32
    [ceil(K/128), ceil(N/128)] (128x128 blocks of ``b``; for an [N, K] weight's scales pass
    ``w_scale.t()``). out_dtype: bfloat16, float16 or float32. bias: [N] or None.
    Returns a contiguous [M, N] tensor. Same as ``torch.ops.fusepass.scaled_mm_blockwise``.
    """
    return call("scaled_mm_blockwise", scaled_mm_blockwise_impl, (a, b, scale_a, scale_b, out_dtype, bias), out_dtype)


# --- fusepass::scaled_mm_blockwise_dynamic ---------------------------------------------------
#
# A float activation quantized per 1x128 group, then ``scaled_mm_blockwise``, as one op:
#
#     q, scale_a = quantize_groups(x, floor)   # scale = max(amax of the group, floor) / 448,
#                                              # q = clamp(x / scale, -448, 448) in e4m3
#     out = scaled_mm_blockwise(q, b, scale_a, scale_b, out_dtype, bias)
#
# ``x`` [M, K] bfloat16, float16 or float32 with K whole 128-wide groups; ``b``, ``scale_b``,
# ``out_dtype`` and ``bias`` as ``scaled_mm_blockwise``'s; ``floor`` > 0 (what ``fusepass.
# prepare``'s fp8-block linears and compressed-tensors' FP8_BLOCK quantize with). Why an op: at
# M = 1 on CUDA with ``b = w.t()`` the M = 1 kernel quantizes each group as it reads it
# (``gemv.blockwise_gemv_kernel``'s QUANT), so no quantization kernel runs before it, and the
# RMSNorm before q/k/v and gate/up stays one kernel (its row reduction and the groups' amax
# are reductions of two shapes, which Inductor makes two kernels). Its divisions are IEEE fp32
# ones and its rounding e4m3's nearest even (``ops/dynamic.py`` says what that can change
# against eager CUDA's). Elsewhere, the ATen ops of ``quantize_groups`` and the block-wise op.
# The pass makes these calls (``passes/quantize_in.py``).


def quantize_groups(x: Tensor, floor: float) -> tuple[Tensor, Tensor]:
    """``x`` (M, K) quantized per 1x128 group to e4m3: (q (M, K), scale (M, K / 128) fp32), in
    fp32 whatever ``x``'s dtype: the one group recipe (``integrations/linear.quantize_input``'s
    fp8-block)."""
    groups = x.float().unflatten(-1, (-1, BLOCK))
    scale = groups.abs().amax(dim=-1).clamp(min=floor) / 448.0
    q = (groups / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def scaled_mm_blockwise_dynamic_impl(
    x: Tensor,
    b: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    floor: float = torch.finfo(torch.float32).eps,
) -> Tensor:
    check_blockwise_dynamic_args(OP_DYNAMIC, x, b, scale_b, out_dtype, bias, floor)
    if x.device.type == "cuda" and gemv_quantizes_groups(x, b):
        return launch_gemv_quantized_groups(x, b, scale_b, out_dtype, bias, floor)
    q, scale_a = quantize_groups(x, floor)
    return scaled_mm_blockwise_impl(q, b, scale_a, scale_b, out_dtype, bias)


def scaled_mm_blockwise_dynamic_fake(x, b, scale_b, out_dtype, bias=None, floor=torch.finfo(torch.float32).eps):
    check_blockwise_dynamic_args(OP_DYNAMIC, x, b, scale_b, out_dtype, bias, floor)
    return x.new_empty((x.shape[0], b.shape[1]), dtype=out_dtype)


define("scaled_mm_blockwise_dynamic", scaled_mm_blockwise_dynamic_impl, scaled_mm_blockwise_dynamic_fake)


def scaled_mm_blockwise_dynamic(x, b, scale_b, out_dtype, bias=None, floor=torch.finfo(torch.float32).eps) -> Tensor:
    """``x`` (float [M, K]) quantized per 1x128 group to e4m3 (scale ``max(amax, floor) / 448``),
    then ``scaled_mm_blockwise``: see the comment above. Same as
    ``torch.ops.fusepass.scaled_mm_blockwise_dynamic``."""
    return call("scaled_mm_blockwise_dynamic", scaled_mm_blockwise_dynamic_impl, (x, b, scale_b, out_dtype, bias, floor),
                out_dtype)
