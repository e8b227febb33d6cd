"""The ops ``fusepass::scaled_mm`` and ``fusepass::scaled_mm_azp``: contract and registrations.

Both compute, with ``acc = a @ b`` (int32 for int8, fp32 for fp8) and the epilogue in fp32
rounded once to ``out_dtype``::

    out = scale_a * scale_b * (acc - azp * azp_adj) + bias

Arguments (the order of vLLM's ``cutlass_scaled_mm`` / ``cutlass_scaled_mm_azp``):

- ``a`` [M, K] and ``b`` [K, N]: int8, or float8_e4m3fn (``scaled_mm`` only), the same dtype;
  any strides (``b`` is usually ``w.t()`` of a row-major [N, K] weight).
- ``scale_a``: fp32, per-tensor (numel 1: 0-d, [1], [1, 1]) or per-token ([M, 1] or [M]).
- ``scale_b``: fp32, per-tensor (numel 1) or per-channel ([1, N] or [N]).
- ``out_dtype``: bfloat16, float16 or float32. ``bias``: [N] in one of those dtypes, or None.
- ``azp_adj`` [N] (or [1, N]), int32 or fp32: ``z_a * colsum(b)`` for a per-tensor zero point
  (then ``azp`` is None), or ``colsum(b)`` with ``azp`` [M] (or [M, 1]), int32 or fp32, the
  per-token zero points. All-int32 zero-point terms are applied exactly in int32.

Returns a new contiguous [M, N] tensor of ``out_dtype``. Each op has a fake implementation
(metadata only), a CPU implementation (the exact reference in ``reference.py``) and a CUDA
implementation on the fused Triton kernel (``fusepass.kernels.scaled_mm``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import launch_scaled_mm
from . import reference
from .checks import check_scaled_mm_args

Tensor = torch.Tensor


def _new_output(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _launch(a, b, scale_a, scale_b, out_dtype, bias, azp_adj=None, azp=None) -> Tensor:
    if a.shape[1] == 0:  # empty sum: only the epilogue of a zero accumulator is left
        acc = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.int32 if a.dtype == torch.int8 else torch.float32, device=a.device)
        if azp_adj is not None:
            acc = reference.zero_point_correction(acc, azp_adj, azp)
        return reference.epilogue(acc, scale_a, scale_b, out_dtype, bias)
    # Triton launches on the current device; follow the inputs when they live elsewhere.
    if a.device.index != torch.cuda.current_device():
        with torch.cuda.device(a.device):
            return launch_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)
    return launch_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


# --- scaled_mm ---------------------------------------------------------------------------


@torch.library.custom_op("fusepass::scaled_mm", mutates_args=(), device_types="cpu")
def _scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
) -> Tensor:
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return reference.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)


@_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype, bias=None):
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return _new_output(a, b, out_dtype)


@_scaled_mm.register_kernel("cuda")
def _(a, b, scale_a, scale_b, out_dtype, bias=None):
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return _launch(a, b, scale_a, scale_b, out_dtype, bias)


# --- scaled_mm_azp -----------------------------------------------------------------------


@torch.library.custom_op("fusepass::scaled_mm_azp", mutates_args=(), device_types="cpu")
def _scaled_mm_azp(
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
    return reference.scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)


@_scaled_mm_azp.register_fake
def _(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    check_scaled_mm_args(
        "fusepass.scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, with_azp=True
    )
    return _new_output(a, b, out_dtype)


@_scaled_mm_azp.register_kernel("cuda")
def _(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    check_scaled_mm_args(
        "fusepass.scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, with_azp=True
    )
    return _launch(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


# --- Python wrappers ---------------------------------------------------------------------


def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor:
    """Fused W8A8 matmul: ``out = scale_a * scale_b * (a @ b) + bias``, rounded once.

    a: [M, K] int8 or float8_e4m3fn. b: [K, N], same dtype, any strides (e.g. ``w.t()``).
    scale_a: fp32, numel 1 or per-token [M, 1] / [M]. scale_b: fp32, numel 1 or
    per-channel [1, N] / [N]. out_dtype: bfloat16, float16 or float32. bias: [N] or None.
    Returns a contiguous [M, N] tensor of out_dtype. int8 accumulates exactly in int32,
    fp8 in fp32; the epilogue runs in fp32. Same as ``torch.ops.fusepass.scaled_mm``.
    """
    return torch.ops.fusepass.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)


def scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None) -> Tensor:
    """Fused W8A8 matmul with an activation zero point (asymmetric int8 activations):
    ``out = scale_a * scale_b * (a @ b - azp * azp_adj) + bias``, rounded once.

    a: [M, K] int8; b: [K, N] int8, any strides. Per-tensor zero point z: ``azp_adj`` [N]
    = ``z * b.sum(0)`` and ``azp=None``. Per-token zero points: ``azp`` [M] (or [M, 1]) and
    ``azp_adj`` [N] = ``b.sum(0)``. azp and azp_adj are int32 (exact) or fp32.
    Scales, bias and out_dtype as in :func:`scaled_mm`. Same as
    ``torch.ops.fusepass.scaled_mm_azp``.
    """
    return torch.ops.fusepass.scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)
