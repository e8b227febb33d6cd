"""The op ``fusepass::scaled_grouped_mm_dynamic``: a mixture of experts' float rows quantized per
row, then ``scaled_grouped_mm``, as one op (``scaled_mm_dynamic``'s counterpart for experts)::

    if gate is not None:
        x = silu(gate) * x  # in x's dtype, as eager rounds each op
    q, scale_a = quantize_rows(x, b.dtype, divisor, floor, floor_first)
    out = scaled_grouped_mm(q, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights)

``quantize_rows`` is ``ops/dynamic.py``'s (its recipes and its numbers: the SiLU's ``exp`` and
division are Triton's on a GPU, as in the kernel Inductor makes of the same graph).

Arguments: ``x`` [M, K] bfloat16, float16 or float32, one row a routed row (its expert
``expert_ids[m]``; M may be 0); ``gate`` None or of ``x``'s dtype and shape (a gated expert
MLP: the gate half of the gate/up projection's output, ``x`` its up half); ``b`` [E, K, N] int8
or float8_e4m3fn, ``scale_b`` per expert and channel [E, N] or per expert, ``expert_ids``,
``out_dtype``, ``bias``, ``row_weights``, ``sorted_rows`` and ``block_experts`` as
``scaled_grouped_mm``'s (``fusepass/ops/grouped.py``); ``divisor`` > 0, ``floor`` >= 0,
``floor_first`` None, True or False. Returns a new contiguous [M, N] tensor of ``out_dtype``.

Why an op of its own: at decode (the grouped row kernel's rows, ``policy.grouped_tiles``), with
``b`` contiguous along K and a gate of ``x``'s strides, each program quantizes its row itself (``kernels/gemv.py``'s QUANT and
GATED, in ``grouped_gemv_kernel``), so neither a SiLU-mul nor a quantization kernel runs
between a MoE layer's gate/up and down GEMMs: one launch a layer fewer. Above the row kernel's
rows (``policy.GROUPED_ROWS_MAX_M`` routed rows: b16, prefill), one kernel of its own quantizes
the rows first with the same numbers (``kernels/quantize.py``), and the sorted
blocks take them. Elsewhere (a ``b`` not contiguous along K at the row kernel's rows, a gate of
other strides than ``x``'s, the CPU) it computes the rows with the ATen ops above and runs
``scaled_grouped_mm``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels.grouped_launch import Recipe, grouped_quantizes, launch_scaled_grouped_mm
from .checks import INPUT_DTYPES, X_DTYPES, check_out_dtype, check_tensor, describe, valid_recipe
from .dynamic import quantize_rows
from .grouped import (
    check_expert_ids, check_expert_scales, check_route, check_routed_rest, checked_route, scaled_grouped_mm_impl,
)
from .registry import call, define

Tensor = torch.Tensor
OP = "fusepass.scaled_grouped_mm_dynamic"


def check_grouped_dynamic_args(x, b, scale_b, expert_ids, out_dtype, bias, row_weights, divisor, floor, gate,
                               floor_first, sorted_rows=None, block_experts=None) -> None:
    """Validate the arguments (module docstring); errors name the argument."""
    check_tensor(OP, "x", x, X_DTYPES)
    if gate is not None:
        check_tensor(OP, "gate", gate, X_DTYPES)
        if gate.dtype != x.dtype or gate.shape != x.shape:
            raise ValueError(f"{OP}: `gate` must have `x`'s dtype and shape; got gate {describe(gate)}, x {describe(x)}")
    check_tensor(OP, "b", b, INPUT_DTYPES)
    if x.dim() != 2 or b.dim() != 3 or b.shape[1] != x.shape[1]:
        raise ValueError(f"{OP}: `x` must be [M, K] and `b` [E, K, N] (one [K, N] weight an expert); got x "
                         f"{describe(x)}, b {describe(b)}")
    check_out_dtype(OP, out_dtype)
    if not valid_recipe(divisor, floor):
        raise ValueError(f"{OP}: `divisor` must be > 0 and `floor` >= 0; got {divisor!r}, {floor!r}")
    if not (floor_first is None or isinstance(floor_first, bool)):
        raise ValueError(f"{OP}: `floor_first` must be None, True or False; got {floor_first!r}")
    E, K, N = b.shape
    M = check_expert_ids(OP, expert_ids, x.shape[0], "x")
    if M != x.shape[0]:
        raise ValueError(f"{OP}: `expert_ids` must be [M], one expert a row of `x` (M = {x.shape[0]}); got "
                         f"{describe(expert_ids)}")
    check_expert_scales(OP, scale_b, N, E)
    tensors = {"x": x, "b": b, "scale_b": scale_b, "expert_ids": expert_ids}
    if gate is not None:
        tensors["gate"] = gate
    check_route(OP, sorted_rows, block_experts, M, E, tensors)
    check_routed_rest(OP, tensors, bias, row_weights, M, K, N, E)


def scaled_grouped_mm_dynamic_impl(
    x: Tensor,
    b: Tensor,
    scale_b: Tensor,
    expert_ids: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    row_weights: Optional[Tensor] = None,
    divisor: float = 127.5,
    floor: float = torch.finfo(torch.float32).eps,
    gate: Optional[Tensor] = None,
    floor_first: Optional[bool] = None,
    sorted_rows: Optional[Tensor] = None,
    block_experts: Optional[Tensor] = None,
) -> Tensor:
    check_grouped_dynamic_args(x, b, scale_b, expert_ids, out_dtype, bias, row_weights, divisor, floor, gate,
                               floor_first, sorted_rows, block_experts)
    routed = checked_route(OP, sorted_rows, block_experts, expert_ids, b.shape[0])
    if statically_known_true(x.shape[1] == 0):  # (an empty sum: the bias alone, weighted)
        scale_a = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        return scaled_grouped_mm_impl(x.to(b.dtype), b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights,
                                      sorted_rows, block_experts)
    tiles = grouped_quantizes(x, b, scale_b, expert_ids, gate) if x.device.type == "cuda" else None
    if tiles is not None:  # (the tiles chosen once, here)
        return launch_scaled_grouped_mm(x, b, None, scale_b, expert_ids, out_dtype, bias, row_weights, tiles,
                                        Recipe(divisor, floor, floor_first, gate), routed)
    if gate is not None:
        x = torch.nn.functional.silu(gate) * x
    q, scale_a = quantize_rows(x, b.dtype, divisor, floor, floor_first)
    return scaled_grouped_mm_impl(q, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights, sorted_rows,
                                  block_experts)


def scaled_grouped_mm_dynamic_fake(x, b, scale_b, expert_ids, out_dtype, bias=None, row_weights=None, divisor=127.5,
                                   floor=torch.finfo(torch.float32).eps, gate=None, floor_first=None,
                                   sorted_rows=None, block_experts=None):
    check_grouped_dynamic_args(x, b, scale_b, expert_ids, out_dtype, bias, row_weights, divisor, floor, gate,
                               floor_first, sorted_rows, block_experts)
    return x.new_empty((expert_ids.shape[0], b.shape[2]), dtype=out_dtype)


define("scaled_grouped_mm_dynamic", scaled_grouped_mm_dynamic_impl, scaled_grouped_mm_dynamic_fake)


def scaled_grouped_mm_dynamic(x, b, scale_b, expert_ids, out_dtype, bias=None, row_weights=None, divisor=127.5,
                              floor=torch.finfo(torch.float32).eps, gate=None, floor_first=None, sorted_rows=None,
                              block_experts=None) -> Tensor:
    """``x`` (float [M, K]; given ``gate``, ``silu(gate) * x``) quantized per row to ``b``'s dtype,
    then ``scaled_grouped_mm``: see the module docstring. Same as
    ``torch.ops.fusepass.scaled_grouped_mm_dynamic``."""
    return call("scaled_grouped_mm_dynamic", scaled_grouped_mm_dynamic_impl,
                (x, b, scale_b, expert_ids, out_dtype, bias, row_weights, divisor, floor, gate, floor_first,
                 sorted_rows, block_experts), out_dtype, replay=False)
