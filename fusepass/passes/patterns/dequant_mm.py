"""Row 8 of the pattern catalogue: dequantize, then a float matmul.

Matches ``aten.mm(A, B)`` / ``aten.addmm(bias, A, B)`` (what ``x @ w.t()`` and
``F.linear`` become) where both operands are dequantized int8 or fp8 tensors:

    A = q_a.to(f) * s_a      s_a per-tensor or per-token; A may be a 3-D x viewed to 2-D
    B = (q_w.to(f) * s_w).t() with s_w per-tensor or per-output-channel [N, 1]
        or q_b.to(f) * s_b   with s_b [1, N]

then any epilogue after it (bias, casts, views; see ``epilogue.walk``).
Becomes ``fusepass.scaled_mm(q_a, q_w.t(), s_a, s_w, out_dtype, bias)``: the integer
products are exact instead of products of rounded dequantized values.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..epilogue import Epilogue, walk
from ..graph import FLOAT_DTYPES, QUANT_DTYPES, VIEW_OPS, Axis, Rejected, aten, cast_dtype, classify, is_call, single_user, tensor_val
from ..rewrite import Candidate, check_operands

ANCHORS = (aten.mm.default, aten.addmm.default)
NAMES = ("dequant_mm",)
_QUANT = (torch.int8, torch.float8_e4m3fn)  # what the ops take


def _dequant(node):
    """(q, scale) if ``node`` is ``q.to(float) * scale`` with an 8-bit ``q``, else None."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for x, s in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if cast_dtype(x) in FLOAT_DTYPES and tensor_val(x.args[0]).dtype in QUANT_DTYPES:
            return x.args[0], s
    return None


def _only_user(node: fx.Node, what: str) -> None:
    if single_user(node) is None:
        raise Rejected(f"the dequantized {what} {node} has {len(node.users)} users")


def _activation(A: fx.Node):
    """(q, scale, its Axis, view args or None) of a dequantized [M, K] A (or a 3-D one viewed to 2-D)."""
    view = None
    if is_call(A, *VIEW_OPS):
        _only_user(A, "activation")
        view, A = A.args[1], A.args[0]
    deq = _dequant(A)
    if deq is None:
        return None
    _only_user(A, "activation")
    q, s = deq
    axis = classify(s, list(tensor_val(A).shape))
    if axis not in (Axis.ROW, Axis.TENSOR):
        raise Rejected(f"activation scale {s} varies along K; only per-token or per-tensor fold out of the sum")
    return q, s, axis, view


def _weight(B: fx.Node):
    """(q, scale, its Axis on the output, transposed) of a dequantized [K, N] B, or of the
    transpose of an [N, K] one."""
    transposed = is_call(B, aten.permute.default) and list(B.args[1]) == [1, 0] or is_call(B, aten.t.default)
    inner = B.args[0] if transposed else B
    deq = _dequant(inner)
    if deq is None:
        return None
    _only_user(inner, "weight")
    if transposed:
        _only_user(B, "weight")
    q, s = deq
    axis = classify(s, list(tensor_val(inner).shape))
    if axis not in (Axis.ROW if transposed else Axis.COL, Axis.TENSOR):
        raise Rejected(f"weight scale {s} varies along K; only per-channel or per-tensor fold out of the sum")
    return q, s, Axis.TENSOR if axis is Axis.TENSOR else Axis.COL, transposed


def match(node, config) -> Candidate | None:
    if node.target is aten.addmm.default:
        bias, A, B = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise Rejected("addmm with beta/alpha != 1")
    else:
        bias, (A, B) = None, node.args[:2]
    act, wt = _activation(A), _weight(B)
    if act is None and wt is None:
        return None  # a float matmul: not a quantized one
    if act is None or wt is None:
        side = "activation" if act is None else "weight"
        raise Rejected(f"the {side} operand is not an int8/fp8 tensor dequantized by a multiply")
    (qa, sa, a_axis, a_view), (qw, sw, w_axis, transposed) = act, wt
    check_operands(qa, qw, _QUANT)
    ep = Epilogue()
    ep.add_factor(sa, a_axis)
    ep.add_factor(sw, w_axis)
    if bias is not None:
        if classify(bias, list(tensor_val(node).shape)) is not Axis.COL:
            raise Rejected(f"addmm input {bias} is not a bias vector [N]")
        ep.bias = bias
    ep = walk(node, ep)
    return Candidate("dequant_mm", node, qa, qw, ep, a_view=a_view, b_t=transposed)
