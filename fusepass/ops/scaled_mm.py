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

Each op is a ``torch.library.triton_op``: its implementation below (input checks, then the
CPU reference of ``reference.py`` on CPU tensors, or the fused Triton kernel of
``fusepass.kernels`` on CUDA ones) runs eagerly and is what Inductor traces into its graph, where the kernels are launched by
Inductor's own generated code (see ``fusepass.kernels.launch``). The Python wrappers at the
end (``fusepass.scaled_mm`` ...) call it without the dispatcher where they may, and repeat a
checked call's launch for later calls with the same argument facts (``eager.py``). The fake
implementations (``register_fake`` below) run the checks and give the output's metadata.

On an sm90 GPU, an fp8 ``scaled_mm`` above 64 rows (``launch.FP8_CUBLAS_ABOVE_M``) runs as
cuBLAS's ``torch._scaled_mm`` where that call takes the operands (``launch.cublas_takes_fp8``):
16-byte aligned fp32 scales, a row-major ``a``, a column-major ``b`` (``w.t()``) with 16-byte
aligned rows, K and N multiples of 16, no bias or a bf16 one with a bf16 output, a torch built
with CUDA >= 12.9. A per-tensor scale beside a
per-element one is spread to a vector (M or N floats), as cuBLAS takes no mixed recipe. The
kernel is the faster up to M = 64, cuBLAS above (the measurements: ``launch.FP8_CUBLAS_ABOVE_M``);
the two agree with the exact product within the same bound.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.library import triton_op

from .._compat import plain_dispatch
from ..kernels import launch_scaled_mm
from . import eager, reference
from .checks import check_int_mm_args, check_out_dtype, check_scaled_mm_args

Tensor = torch.Tensor


def _compute(a, b, scale_a, scale_b, out_dtype, bias, azp_adj=None, azp=None) -> Tensor:
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
    return launch_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


def scaled_mm_impl(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
) -> Tensor:
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return _compute(a, b, scale_a, scale_b, out_dtype, bias)


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
    return _compute(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp)


def int_mm_impl(a: Tensor, b: Tensor) -> Tensor:
    check_int_mm_args("fusepass.int_mm", a, b)
    return _compute(a, b, None, None, torch.int32, None)


# The implementation each op's node is lowered to (fusepass.passes.lower).
IMPLS = {}


def register(name: str, impl) -> None:
    """``fusepass::<name>``: a triton_op of ``impl``, lowered as ``impl`` (``IMPLS``), with no
    gradient: a call that would need one raises at the forward (without this, at ``backward()``)."""
    triton_op(f"fusepass::{name}", impl, mutates_args=())
    IMPLS[getattr(torch.ops.fusepass, name).default] = impl

    def refuse(ctx, inputs, output):
        raise RuntimeError(
            f"fusepass.{name} has no gradient: its operands are quantized values. The input gradient of a frozen "
            "quantized linear is its dequantized weight's: fusepass.prepare(model) converts linears into "
            "fusepass.W8A8Linear, which computes it; or call the op under torch.no_grad()")
    torch.library.register_autograd(f"fusepass::{name}", _no_backward, setup_context=refuse)


def _no_backward(ctx, *grads):  # (never reached: ``refuse`` raises first)
    raise RuntimeError("fusepass ops have no gradient")


for _name, _impl in (("scaled_mm", scaled_mm_impl), ("scaled_mm_azp", scaled_mm_azp_impl), ("int_mm", int_mm_impl)):
    register(_name, _impl)


# Fake implementations: the checks and the output's metadata, no arithmetic. Without them a
# fake call ran the whole implementation on fake tensors (the CPU reference, or the launch's
# config choice), 6 ms a call: 1.8 s of the pass's 2.8 s on a 32-layer graph (CPU).
@torch.library.register_fake("fusepass::scaled_mm")
def _scaled_mm_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    check_scaled_mm_args("fusepass.scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("fusepass::scaled_mm_azp")
def _scaled_mm_azp_fake(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    check_scaled_mm_args("fusepass.scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, with_azp=True)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("fusepass::int_mm")
def _int_mm_fake(a, b):
    check_int_mm_args("fusepass.int_mm", a, b)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)


# --- Python wrappers ---------------------------------------------------------------------


def _plain_eager(*tensors) -> bool:
    """True where a call may skip the dispatcher and run the implementation directly
    (``eager.call``): eager (not traced, no mode, no functorch transform), plain tensors,
    nothing that needs autograd. The dispatcher's Python custom-op path costs 25-30 us a
    call on the H200's host. Anything else goes through
    ``torch.ops.fusepass.*``, which also raises the autograd error."""
    if torch.compiler.is_compiling() or not plain_dispatch():
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) is Tensor and not (grad and t.requires_grad)) for t in tensors)


def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor:
    """Fused W8A8 matmul: ``out = scale_a * scale_b * (a @ b) + bias``, rounded once.

    a: [M, K] int8 or float8_e4m3fn. b: [K, N], same dtype, any strides (e.g. ``w.t()``).
    scale_a: fp32 (or bf16 / fp16), numel 1 or per-token [M, 1] / [M]. scale_b: fp32 (or
    bf16 / fp16), numel 1 or per-channel [1, N] / [N]. out_dtype: bfloat16, float16 or
    float32. bias: [N] or None.
    Returns a contiguous [M, N] tensor of out_dtype. int8 accumulates exactly in int32,
    fp8 in fp32; the epilogue runs in fp32. Same as ``torch.ops.fusepass.scaled_mm``.
    """
    if _plain_eager(a, b, scale_a, scale_b, bias):
        return eager.call(scaled_mm_impl, a, b, scale_a, scale_b, out_dtype, bias)
    check_out_dtype("fusepass.scaled_mm", out_dtype)  # (the dispatcher's own error is less clear)
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
    if _plain_eager(a, b, scale_a, scale_b, azp_adj, azp, bias):
        return eager.call(scaled_mm_azp_impl, a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)
    check_out_dtype("fusepass.scaled_mm_azp", out_dtype)  # (the dispatcher's own error is less clear)
    return torch.ops.fusepass.scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)


def int_mm(a, b) -> Tensor:
    """int8 [M, K] x int8 [K, N] -> exact int32 [M, N], at every M (``torch._int_mm`` on
    CUDA needs M > 16). Same as ``torch.ops.fusepass.int_mm``."""
    if _plain_eager(a, b):
        return eager.call(int_mm_impl, a, b)
    return torch.ops.fusepass.int_mm(a, b)
