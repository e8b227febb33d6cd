"""Quantize a decode activation inside the M = 1 kernel where it saves a launch. By default
where the launches run outside CUDA graphs (``PassConfig.quantize_in_gemv``; the numbers there).

Matches: an int8 or fp8 ``fusepass.scaled_mm`` call at a static M = 1, ``b`` stored as
``w.t()``, whose ``a`` and ``scale_a`` are the per-token quantization of a float row ``x`` and
used by nothing else, in the ATen forms ``ops.dynamic.quantize_rows`` traces (a
``fusepass.prepare``d linear traces the same): int8 ``clamp_max(clamp_min(round(xf / s), -128),
127).to(int8)``, fp8 ``clamp_max(clamp_min(xf / s, -448), 448).to(float8_e4m3fn)``, with ``s`` =
``clamp_min(amax(abs(xf), -1) / D, F)`` or ``clamp_min(amax(abs(xf), -1), F) / D`` in fp32 (either
for either dtype: ``floor_first``); ``xf`` is ``x`` cast to fp32, or ``x``, and the amax may be
taken in ``x``'s dtype then cast (the same values), as a hand-written linear does
(``fusepass.demo.handwritten``: also an fp8 row cast without the clamp, the same values where
D <= 448 and the floor keeps ``s`` a normal fp32 number, since ``|xf / s| <= D`` up to a rounding
and e4m3 rounds up to 464 to 448); where either

- ``x`` comes through views from an output of a multi-output op (a ``getitem``: attention),
  which runs as a kernel of its own that Inductor cannot fuse the quantization into; or
- ``x`` is a gated MLP's ``silu(g) * u`` as its traced graph holds it (``mul(silu, u)`` or
  ``mul(u, silu)``, ``silu`` = ``gf / (1 + exp(-gf))`` (an ``add`` with no ``alpha``) with ``gf``
  = ``g`` cast to fp32 and the result cast back to ``u``'s dtype, or all of it in fp32), ``g``
  and ``u`` tensors of one dtype and shape, ``x`` of a static shape and used by nothing but the
  quantization.

Becomes: ``fusepass.scaled_mm_dynamic(x, b, scale_b, out_dtype, bias, D, F)``, or for the
gated row ``fusepass.scaled_mm_dynamic(u, b, scale_b, out_dtype, bias, D, F, g)``, with
``floor_first`` last where the order is not the dtype's own (``None`` in the gate's place for
a plain row); on CUDA the
M = 1 kernel quantizes (and gates) the row itself (``kernels/gemv.py``). A Llama layer's
o_proj and down_proj: o_proj's quantization is the one of a decode layer that Inductor launches
on its own (q/k/v's and gate/up's fuse into the RMSNorm kernel); down_proj's is fused with the
SiLU-mul into a kernel that the gated row makes unnecessary. Why: a default-mode decode step is
bound by its launches, and these are two of a layer's 17; inside CUDA graphs a launch costs
nothing and each program reads the row (and the gate) twice more, so there the default leaves
them to their kernels (docs/PERFORMANCE.md, "Why the code is as it is": "Quantization in the M = 1 launch").
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from .. import ops  # noqa: F401  (registers torch.ops.fusepass.*)
from ..kernels.policy import floors_first
from ..ops.checks import valid_recipe
from .graph import VIEW_OPS, Inserter, aten, cast_dtype, is_call, peel_views, schema_args, tensor_val

fusepass = torch.ops.fusepass
NAME = "quantized_in_gemv"
_PASSING = (*VIEW_OPS, aten.permute.default, aten.clone.default, aten.unsqueeze.default, aten.squeeze.dim)


def _one_arg(node, target, *consts):
    """``x`` where ``node`` is ``target(x, *consts)``, else None."""
    if is_call(node, target) and list(node.args[1:]) == list(consts):
        return node.args[0]
    return None


def _abs_of(node):
    """The ``abs(x)`` node where ``node`` is ``amax(abs(x), [-1], True)``, or that of a bf16 or
    fp16 ``x`` cast to fp32 (a hand-written form's: the same values), else None."""
    if cast_dtype(node) == torch.float32 and tensor_val(node.args[0]).dtype in (torch.bfloat16, torch.float16):
        node = node.args[0]
    if not is_call(node, aten.amax.default) or list(node.args[1:]) not in ([[-1], True], [[1], True]):
        return None
    return node.args[0] if is_call(node.args[0], aten.abs.default) else None


def _is_nan(node) -> bool:
    """A NaN made by ``full([], nan)`` (AOTAutograd's form) or ``scalar_tensor(nan)`` (a traced
    ``torch.where(..., nan, ...)``, as ``passes/expand.py`` leaves it)."""
    if is_call(node, aten.full.default):
        return math.isnan(node.args[1])
    return is_call(node, aten.scalar_tensor.default) and math.isnan(node.args[0])


def _scale(s):
    """(abs(x), D, F, floor_first) where ``s`` is ``clamp_min(amax(abs(x)) / D, F)`` or
    (``floor_first``) ``clamp_min(amax(abs(x)), F) / D``, with D > 0 and F >= 0 (what the op
    takes), or either with an infinite value made NaN (``where(isinf(s), nan, s)``: a prepared
    int8 linear's, which the op's kernel computes too), else None."""
    if (is_call(s, aten.where.self) and is_call(s.args[0], aten.isinf.default) and s.args[0].args[0] is s.args[2]
            and _is_nan(s.args[1])):
        s = s.args[2]
    if is_call(s, aten.div.Tensor) and is_call(s.args[0], aten.clamp_min.default):
        div, clamp, floor_first = s, s.args[0], True
    elif is_call(s, aten.clamp_min.default) and is_call(s.args[0], aten.div.Tensor):
        div, clamp, floor_first = s.args[0], s, False
    else:
        return None
    divisor, floor = div.args[1], clamp.args[1]
    if not valid_recipe(divisor, floor):
        return None
    abs_ = _abs_of(s.args[0].args[0])
    return None if abs_ is None else (abs_, float(divisor), float(floor), floor_first)


# The quantized row's last steps by dtype: q = clamp_max(clamp_min(v, lo), hi) with v = xf / s
# (int8: round(xf / s)), then cast.
_CLAMPS = {torch.int8: (-128, 127), torch.float8_e4m3fn: (-448.0, 448.0)}
_TINY = torch.finfo(torch.float32).tiny


def _quantization(a):
    """(x, s, D, F, floor_first, nodes: those that read ``x``) where ``a`` is the quantized row
    (module docstring), else None."""
    dtype = cast_dtype(a)
    if dtype not in _CLAMPS:
        return None
    lo, hi = _CLAMPS[dtype]
    v = _one_arg(_one_arg(a.args[0], aten.clamp_max.default, hi), aten.clamp_min.default, lo)
    if v is None and dtype == torch.float8_e4m3fn:
        v = a.args[0]  # (unclamped: the same values where D <= 448, checked below)
        clamped = False
    else:
        clamped = True
    if dtype == torch.int8:
        v = _one_arg(v, aten.round.default)
    if not (is_call(v, aten.div.Tensor) and isinstance(v.args[1], fx.Node) and tensor_val(v).dtype == torch.float32):
        return None
    found = _scale(v.args[1])
    if found is None or found[0].args[0] is not v.args[0]:
        return None
    abs_, divisor, floor, floor_first = found
    # Unclamped fp8 equals clamped where |xf / s| stays below 464 (e4m3 rounds it to 448): s at
    # least amax / D (a rounding off) with D <= 448, and s a normal fp32 number (a subnormal s
    # loses the digits that keep it: amax 1.3e-42, F 0 gave |xf / s| = 477).
    if not clamped and not (divisor <= 448.0 and (floor / divisor if floor_first else floor) >= _TINY):
        return None
    xf = abs_.args[0]
    x = xf.args[0] if cast_dtype(xf) == torch.float32 else xf
    if tensor_val(x).dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return x, v.args[1], divisor, floor, floor_first, {xf} if xf is not x else {v, abs_}


def _silu_of(node, dtype):
    """``g`` where ``node`` is ``silu(g)`` of a ``dtype`` row as decomposed (module docstring)."""
    if dtype != torch.float32:
        if cast_dtype(node) != dtype:
            return None
        node = node.args[0]
    if not (is_call(node, aten.div.Tensor) and is_call(node.args[1], aten.add.Tensor)
            and node.args[1].args[1] == 1 and not node.args[1].kwargs):  # (no alpha)
        return None
    gf = node.args[0]
    if _one_arg(_one_arg(node.args[1].args[0], aten.exp.default), aten.neg.default) is not gf:
        return None
    g = gf if dtype == torch.float32 else gf.args[0] if cast_dtype(gf) == torch.float32 else None
    return g if g is not None and tensor_val(g).dtype == dtype else None


def _gated(x, quantization: set):
    """(g, u) where ``x`` is (through views used once) ``silu(g) * u`` used by nothing but the
    ``quantization``'s nodes, and of a static shape (the op's rows are reshaped to it), else None."""
    if set(x.users) - quantization or not all(is_concrete_int(d) for d in tensor_val(x).shape):
        return None
    mul = x
    while is_call(mul, *VIEW_OPS) and len(mul.args[0].users) == 1:
        mul = mul.args[0]
    if not is_call(mul, aten.mul.Tensor):
        return None
    vals = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in mul.args]
    if not all(isinstance(v, torch.Tensor) for v in vals):  # (a scalar factor, a SymInt's node)
        return None
    dtype = tensor_val(mul).dtype
    for (silu, u), uval in ((mul.args, vals[1]), (mul.args[::-1], vals[0])):
        g = _silu_of(silu, dtype)
        if g is not None and uval.dtype == dtype and tensor_val(g).shape == uval.shape:
            return g, u
    return None


def _from_multi_output(x) -> bool:
    """``x`` is (through views) an output of a multi-output op: a ``getitem``."""
    while is_call(x, *_PASSING):
        x = x.args[0]
    return is_call(x, operator.getitem)


def _m1_calls(graph: fx.Graph, target):
    """(node, its arguments) of each ``target`` call at a static M = 1 with ``b`` stored as
    ``w.t()`` whose ``a`` has no other user: the calls whose row an M = 1 launch can quantize."""
    for node in list(graph.find_nodes(op="call_function", target=target)):
        args = schema_args(node)
        a, b = args[0], args[1]
        if (statically_known_true(tensor_val(a).shape[0] == 1) and statically_known_true(tensor_val(b).stride(0) == 1)
                and len(a.users) == 1):
            yield node, args


def quantize_in_gemv(graph: fx.Graph) -> list[str]:
    """Rewrite each matching call (module docstring); returns the names of those replaced."""
    done = []
    for node, (a, b, scale_a, scale_b, out_dtype, bias) in _m1_calls(graph, fusepass.scaled_mm.default):
        found = _quantization(a)
        if found is None or peel_views(scale_a) is not found[1]:
            continue
        x, _, divisor, floor, floor_first, readers = found
        gated = _gated(x, readers)
        if gated is None and not _from_multi_output(x):
            continue
        ins = Inserter(graph, node)
        if gated is None:
            args = [x, b, scale_b, out_dtype, bias, divisor, floor]
        else:  # (as rows of x's shape: the gated MLP's are (B, S, K))
            g, u = (t if tensor_val(t).shape == tensor_val(x).shape else
                    ins.call(aten.reshape.default, t, list(tensor_val(x).shape)) for t in gated)
            args = [u, b, scale_b, out_dtype, bias, divisor, floor, g]
        if floor_first != floors_first(tensor_val(a).dtype):  # (not the dtype's own recipe)
            args += [None] * (8 - len(args)) + [floor_first]
        new = ins.call(fusepass.scaled_mm_dynamic.default, *args)
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done.append(node.name)
    return done


# --- fp8-block rows: quantized_groups_in_gemv -------------------------------------------------
#
# Matches: a ``fusepass.scaled_mm_blockwise`` call at a static M = 1, ``b`` stored as ``w.t()``,
# whose ``a`` and ``scale_a`` are the 1x128-group quantization of a float row ``x`` and used by
# nothing else, in the ATen forms ``fusepass.prepare``'s fp8-block linears trace
# (``ops.blockwise.quantize_groups``): ``xg`` = ``x`` cast to fp32 viewed as [1, K / 128, 128],
# ``s = clamp_min(amax(abs(xg), -1), F) / 448``, ``a`` = (through views)
# ``clamp_max(clamp_min(xg / s.unsqueeze(-1), -448), 448).to(float8_e4m3fn)``, ``scale_a`` a
# view of ``s``; F > 0. Becomes ``fusepass.scaled_mm_blockwise_dynamic(x, b, scale_b,
# out_dtype, bias, F)``, whose M = 1 kernel (where it runs: ``ops/blockwise.py``) quantizes each
# group as it reads it: the quantization was a kernel of its own, one a linear a layer (the
# RMSNorm before q/k/v and gate/up and the groups' amax are reductions of two shapes, which
# Inductor makes two kernels). A group's scale needs no read of the row beforehand (a per-token
# one does: ``quantize_in_gemv``'s reason to stay out of CUDA graphs), so in CUDA graphs too
# (``PassConfig.quantize_groups_in_gemv``: the numbers there).
GROUPS_NAME = "quantized_groups_in_gemv"


def _group_quantization(a, scale_a):
    """(x, F) where ``a`` and ``scale_a`` are the group quantization above, else None."""
    q = peel_views(a)
    if cast_dtype(q) != torch.float8_e4m3fn:
        return None
    v = _one_arg(_one_arg(q.args[0], aten.clamp_max.default, 448.0), aten.clamp_min.default, -448.0)
    if not (is_call(v, aten.div.Tensor) and is_call(v.args[1], aten.unsqueeze.default)
            and list(v.args[1].args[1:]) in ([-1], [2])):
        return None
    xg, s = v.args[0], v.args[1].args[0]
    if peel_views(scale_a) is not s or not is_call(s, aten.div.Tensor) or s.args[1] != 448.0:
        return None
    floor_node = s.args[0]
    if not (is_call(floor_node, aten.clamp_min.default) and isinstance(floor_node.args[1], (int, float))
            and floor_node.args[1] > 0):
        return None
    amax = floor_node.args[0]
    if not (is_call(amax, aten.amax.default) and list(amax.args[1:]) in ([[-1]], [[2]], [[-1], False], [[2], False])
            and is_call(amax.args[0], aten.abs.default) and amax.args[0].args[0] is xg):
        return None
    shape = tensor_val(xg).shape
    if not (is_call(xg, *VIEW_OPS) and len(shape) == 3 and statically_known_true(shape[2] == 128)):
        return None
    xf = xg.args[0]
    x = xf.args[0] if cast_dtype(xf) == torch.float32 else xf
    if tensor_val(x).dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return x, float(floor_node.args[1])


def quantize_groups_in_gemv(graph: fx.Graph) -> list[str]:
    """Rewrite each matching call (the comment above); returns the names of those replaced."""
    done = []
    for node, (a, b, scale_a, scale_b, out_dtype, bias) in _m1_calls(graph, fusepass.scaled_mm_blockwise.default):
        found = _group_quantization(a, scale_a)
        if found is None:
            continue
        x, floor = found
        ins = Inserter(graph, node)
        row = x if len(tensor_val(x).shape) == 2 else ins.call(aten.reshape.default, x, [1, tensor_val(a).shape[1]])
        new = ins.call(fusepass.scaled_mm_blockwise_dynamic.default, row, b, scale_b, out_dtype, bias, floor)
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done.append(node.name)
    return done
