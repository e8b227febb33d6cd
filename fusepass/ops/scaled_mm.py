"""The ops ``fusepass::scaled_mm``, ``fusepass::scaled_mm_azp`` and ``fusepass::int_mm``:
contract and registrations.

``scaled_mm`` and ``scaled_mm_azp`` compute, with ``acc = a @ b`` (int32 for int8, fp32
for fp8) and the epilogue in fp32 rounded once to ``out_dtype``::

    out = scale_a * scale_b * (acc - azp * azp_adj) + bias

Arguments (the order of vLLM's ``cutlass_scaled_mm`` / ``cutlass_scaled_mm_azp``):

- ``a`` [M, K] and ``b`` [K, N]: int8, or float8_e4m3fn (``scaled_mm`` only), the same dtype;
  any strides (``b`` is usually ``w.t()`` of a row-major [N, K] weight). Any M >= 0.
- ``scale_a``: fp32, per-tensor (numel 1: 0-d, [1], [1, 1]) or per-token ([M, 1] or [M]).
- ``scale_b``: fp32, per-tensor (numel 1) or per-channel ([1, N] or [N]).
  Either scale may also be bf16 or fp16 (torchao keeps some in bf16): widened to fp32,
  exactly, where it is read.
- ``out_dtype``: bfloat16, float16 or float32. ``bias``: [N] in one of those dtypes, or None.
- ``azp_adj`` [N] (or [1, N]), int32 or fp32: ``z_a * colsum(b)`` for a per-tensor zero point
  (then ``azp`` is None), or ``colsum(b)`` with ``azp`` [M] (or [M, 1]), int32 or fp32, the
  per-token zero points. All-int32 zero-point terms are applied exactly in int32.

Returns a new contiguous [M, N] tensor of ``out_dtype``.

``int_mm(a, b)``: int8 [M, K] x int8 [K, N] -> the exact int32 [M, N] product, at every M
(``torch._int_mm`` on CUDA needs M > 16 and K, N multiples of 8). The pass routes the int8
matmuls it cannot fuse here, so a compiled model never stops on them.

Each op is registered as every fusepass op is (``registry.define``: the implementation below,
a fake, no gradient); the Python wrappers at the end (``fusepass.scaled_mm`` ...) call it
through ``registry.call``.

On an sm90 GPU, an fp8 ``scaled_mm`` above 64 rows (``policy.FP8_CUBLAS_ABOVE_M``) runs as
cuBLAS's ``torch._scaled_mm`` where that call takes the operands (``launch.cublas_takes_fp8``):
16-byte aligned fp32 scales, a row-major ``a``, a column-major ``b`` (``w.t()``) with 16-byte
aligned rows, K and N multiples of 16, no bias or a bf16 one with a bf16 output, a torch built
with CUDA >= 12.9. A per-tensor scale beside a
per-element one is spread to a vector (M or N floats), as cuBLAS takes no mixed recipe. The
kernel is the faster up to M = 64, cuBLAS above (the measurements: ``policy.FP8_CUBLAS_ABOVE_M``);
the two agree with the exact product within the same bound.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels import launch_scaled_mm
from . import reference
from .checks import check_int_mm_args, check_scaled_mm_args
from .registry import call, define, launch_graphs

Tensor = torch.Tensor


def compute(a, b, scale_a, scale_b, out_dtype, bias, azp_adj=None, azp=None) -> Tensor:
    """``scaled_mm`` (``scaled_mm_azp`` given ``azp_adj``; ``int_mm`` for an int32 ``out_dtype``)
    on validated arguments, any device: the other ops' implementations share it."""
    if statically_known_true(a.shape[1] == 0):
        # An empty sum is zero whatever the scales (torch._scaled_mm's answer, also for
        # infinite ones, where zeros times the scales would be NaN): the bias alone.
        out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
        return out if bias is None else out + bias.to(out_dtype)
    if a.device.type != "cuda":  # CPU (and meta): the exact reference
        if out_dtype == torch.int32:
            return reference.accumulate(a, b)
        if azp_adj is None:
            return reference.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)
        return reference.scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)
    return launch_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, graphs=launch_graphs(a))


def scaled_mm_impl(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
) -> Tensor:
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return compute(a, b, scale_a, scale_b, out_dtype, bias)


def scaled_mm_azp_impl(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    azp_adj: Tensor,
    azp: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
) -> Tensor:
    check_scaled_mm_args(
        "fusepass.scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, with_azp=True
    )
    return compute(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


def int_mm_impl(a: Tensor, b: Tensor) -> Tensor:
    check_int_mm_args("fusepass.int_mm", a, b)
    return compute(a, b, None, None, torch.int32, None)


# Fake implementations: the checks and the output's metadata (``registry``).
def scaled_mm_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def scaled_mm_azp_fake(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    check_scaled_mm_args("fusepass.scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, with_azp=True)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def int_mm_fake(a, b):
    check_int_mm_args("fusepass.int_mm", a, b)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)


define("scaled_mm", scaled_mm_impl, scaled_mm_fake)
define("scaled_mm_azp", scaled_mm_azp_impl, scaled_mm_azp_fake)
define("int_mm", int_mm_impl, int_mm_fake)


# --- Python wrappers ---------------------------------------------------------------------


def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor:
    """Fused W8A8 matmul: ``out = scale_a * scale_b * (a @ b) + bias``, rounded once.

    a: [M, K] int8 or float8_e4m3fn. b: [K, N], same dtype, any strides (e.g. ``w.t()``).
    scale_a: fp32 (or bf16 / fp16), numel 1 or per-token [M, 1] / [M]. scale_b: fp32 (or
    bf16 / fp16), numel 1 or per-channel [1, N] / [N]. out_dtype: bfloat16, float16 or
    float32. bias: [N] or None.
    Returns a contiguous [M, N] tensor of out_dtype. int8 accumulates exactly in int32,
    fp8 in fp32; the epilogue runs in fp32. Same as ``torch.ops.fusepass.scaled_mm``.
    """
    return call("scaled_mm", scaled_mm_impl, (a, b, scale_a, scale_b, out_dtype, bias), out_dtype)


def scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None) -> Tensor:
    """Fused W8A8 matmul with an activation zero point (asymmetric int8 activations):
    ``out = scale_a * scale_b * (a @ b - azp * azp_adj) + bias``, rounded once.

    a: [M, K] int8; b: [K, N] int8, any strides. Per-tensor zero point z: ``azp_adj`` [N]
    = ``z * b.sum(0)`` and ``azp=None``. Per-token zero points: ``azp`` [M] (or [M, 1]) and
    ``azp_adj`` [N] = ``b.sum(0)``. azp and azp_adj are int32 (exact) or fp32.
    Scales, bias and out_dtype as in :func:`scaled_mm`. Same as
    ``torch.ops.fusepass.scaled_mm_azp``.
    """
    return call("scaled_mm_azp", scaled_mm_azp_impl, (a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias), out_dtype)


def int_mm(a, b) -> Tensor:
    """int8 [M, K] x int8 [K, N] -> exact int32 [M, N], at every M (``torch._int_mm`` on
    CUDA needs M > 16). Same as ``torch.ops.fusepass.int_mm``."""
    return call("int_mm", int_mm_impl, (a, b))
