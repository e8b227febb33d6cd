"""The op ``fusepass::scaled_mm_dynamic``: a float activation quantized per token, then
``scaled_mm``, as one op.

    if gate is not None:
        x = silu(gate) * x  # in x's dtype, as eager rounds each op
    q, scale_a = quantize_rows(x, b.dtype, divisor, floor, floor_first)
    out = scaled_mm(q, b, scale_a, scale_b, out_dtype, bias)

``quantize_rows``, in fp32 with correctly rounded divisions (torchao's and compressed-tensors'
dynamic per-token recipes, as ``fusepass.prepare``'s modules quantize, and the hand-written
forms' with ``floor_first``):

- ``b`` int8: ``scale = max(amax / divisor, floor)``, ``q = clamp(round(x / scale), -128, 127)``
  (round half to even; ``divisor`` 127.5 for torchao and compressed-tensors);
- ``b`` float8_e4m3fn: ``scale = max(amax, floor) / divisor``, ``q = clamp(x / scale, -448,
  448)`` cast to e4m3 (``divisor`` 448);
- ``floor_first`` True: ``scale = max(amax, floor) / divisor``; False: ``max(amax / divisor,
  floor)``; None: the dtype's own, above (a hand-written int8 linear floors first).

Arguments: ``x`` [M, K] bfloat16, float16 or float32; ``b``, ``scale_b``, ``out_dtype`` and
``bias`` as ``scaled_mm``'s (``fusepass/ops/scaled_mm.py``); ``divisor`` > 0, ``floor`` >= 0;
``gate`` None or a tensor of ``x``'s dtype, shape and device (a gated MLP's gate projection:
``x`` is then its up projection, and the row quantized the SiLU-mul of the two); ``floor_first``
None, True or False. Returns a new contiguous [M, N] tensor of ``out_dtype``.

Why an op of its own: at M = 1 (decode at batch 1) on CUDA, with an int8 or e4m3 ``b = w.t()``,
the M = 1 kernel quantizes the row itself (``kernels/gemv.py``, QUANT: each program reads the
row's amax, then its blocks, from L2), so no quantization kernel runs before it: one launch a
call fewer. With a ``gate`` of ``x``'s strides it also computes the SiLU-mul (GATED: ``g / (1 +
exp(-g))`` in fp32, as Inductor's decomposition, each op rounded to ``x``'s dtype), so no
SiLU-mul kernel runs either.

Its numbers: its divisions are IEEE fp32 divisions and its roundings to the nearest even
(int8 steps, e4m3's grid, bf16); eager CUDA divides by a Python float as a multiply by its
reciprocal and Inductor's ``x / s`` may be approximate, so its scale can be an fp32 rounding
apart from theirs, and a value at a rounding tie can then land on the neighbouring step; the SiLU's ``exp`` and division are Triton's
(approximate on a GPU, as in the kernel Inductor makes of the same graph), not eager CUDA's,
so a gated value can round to a neighbour of eager's in ``x``'s dtype. All within the numerics
policy; in Triton's interpreter its values equal the CPU's for finite rows. A row holding a
NaN or an infinity gives a NaN scale, so NaN outputs, as eager's (its scale is NaN or
infinite); a row of zeros with ``floor`` 0 gives the bias alone where eager's ``0 / 0`` gives
NaN for fp8.

Elsewhere (other M, other layouts, the CPU) it computes the row with the ATen ops above and
runs ``scaled_mm``; traced, Inductor fuses that into its own kernels as before. The pass makes
these calls where the launches run outside CUDA graphs (or where
``PassConfig.quantize_in_gemv`` says so), and only where they save a kernel
(``passes/quantize_in.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels.launch import gemv_quantizes, launch_gemv_quantized
from ..kernels.policy import floors_first
from .checks import check_dynamic_args
from .registry import call, define
from .scaled_mm import compute

Tensor = torch.Tensor


def quantize_rows(x: Tensor, dtype: torch.dtype, divisor: float, floor: float,
                  floor_first: Optional[bool] = None, ceiling: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """``x`` (M, K) quantized per row to ``dtype`` (int8 or float8_e4m3fn): (q, scale (M, 1) fp32)
    (``floor_first``: the module docstring; ``ceiling``: where the floor comes first, an upper
    bound on a row's amax too, FBGEMM FP8's ``activation_scale_ub``). The one per-row recipe:
    ``fusepass.prepare``'s linears quantize with it (``integrations/linear.quantize_input``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if floors_first(dtype, floor_first):
        scale = (amax.clamp(min=floor) if ceiling is None else amax.clamp(floor, ceiling)) / divisor
    elif ceiling is not None:
        raise ValueError(f"quantize_rows: a ceiling bounds the amax where the floor comes first; got {ceiling!r} with "
                         "floor_first False")
    else:
        scale = (amax / divisor).clamp(min=floor)
    if dtype == torch.float8_e4m3fn:
        return (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
    scale = torch.where(scale.isinf(), float("nan"), scale)  # (linear.nan_if_infinite: why)
    return (xf / scale).round().clamp(-128, 127).to(torch.int8), scale


def scaled_mm_dynamic_impl(
    x: Tensor,
    b: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    divisor: float = 127.5,
    floor: float = torch.finfo(torch.float32).eps,
    gate: Optional[Tensor] = None,
    floor_first: Optional[bool] = None,
) -> Tensor:
    check_dynamic_args(x, b, scale_b, out_dtype, bias, divisor, floor, gate, floor_first)
    if statically_known_true(x.shape[1] == 0):
        return compute(x, b, None, scale_b, out_dtype, bias)  # (an empty sum: the bias alone)
    if x.device.type == "cuda" and gemv_quantizes(x, b, gate):
        return launch_gemv_quantized(x, b, scale_b, out_dtype, bias, divisor, floor, gate, floor_first)
    if gate is not None:
        x = torch.nn.functional.silu(gate) * x
    q, scale_a = quantize_rows(x, b.dtype, divisor, floor, floor_first)
    return compute(q, b, scale_a, scale_b, out_dtype, bias)


def scaled_mm_dynamic_fake(x, b, scale_b, out_dtype, bias=None, divisor=127.5,
                           floor=torch.finfo(torch.float32).eps, gate=None, floor_first=None):
    check_dynamic_args(x, b, scale_b, out_dtype, bias, divisor, floor, gate, floor_first)
    return x.new_empty((x.shape[0], b.shape[1]), dtype=out_dtype)


define("scaled_mm_dynamic", scaled_mm_dynamic_impl, scaled_mm_dynamic_fake)


def scaled_mm_dynamic(x, b, scale_b, out_dtype, bias=None, divisor=127.5,
                      floor=torch.finfo(torch.float32).eps, gate=None, floor_first=None) -> Tensor:
    """``x`` (float [M, K]; given ``gate``, ``silu(gate) * x``) quantized per token to ``b``'s
    dtype, then ``scaled_mm``: see the module docstring. Same as
    ``torch.ops.fusepass.scaled_mm_dynamic``."""
    return call("scaled_mm_dynamic", scaled_mm_dynamic_impl,
                (x, b, scale_b, out_dtype, bias, divisor, floor, gate, floor_first), out_dtype, replay=False)
