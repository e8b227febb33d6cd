"""``dequant_mm`` (``docs/PATTERNS.md``): dequantize, then a float matmul.

Matches ``aten.mm(A, B)`` / ``aten.addmm(bias, A, B)`` (what ``x @ w.t()`` and
``F.linear`` become), and ``(A.float().unsqueeze(2) * B.float().unsqueeze(0)).sum(1)``
(what Inductor decomposes an M = 1 ``mm`` into on CUDA), where both operands are
dequantized int8 or fp8 tensors:

    A = q_a.to(f) * s_a      s_a per-tensor or per-token; A may be a 3-D x viewed to 2-D
        or (q_a.to(f) - z_a) * s_a   int8, with a per-token or per-tensor zero point z_a
        (torchao's asymmetric activations where it does not take ``_int_mm``: torchao 0.17
        on CUDA)
    B = (q_w.to(f) * s_w).t() with s_w per-tensor or per-output-channel [N, 1]
        or q_b.to(f) * s_b   with s_b [1, N]

then any epilogue after it (bias, casts, views; see ``epilogue.walk``). A dequantized activation
may have other users (siblings' matmuls on one dequantized value, as a model that dequantizes
once writes them and as Inductor's CSE once left q/k/v's under freezing, or anything else):
the fused op reads ``q_a``, and the dequantization stays for them. A dequantized weight must
have no other.
Becomes ``fusepass.scaled_mm(q_a, q_w.t(), s_a, s_w, out_dtype, bias)``, or with a zero
point ``fusepass.scaled_mm_azp`` with ``azp_adj`` the column sums of ``q_w`` (computed in
the graph): the integer products are exact instead of products of rounded dequantized
values. (``q_a - z_a`` is exact in the float graph too: |q_a - z_a| <= 255 fits bf16.)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..epilogue import Epilogue, walk
from ..graph import FLOAT_DTYPES, QUANT_DTYPES, VIEW_OPS, Axis, Rejected, aten, cast_dtype, classify, describe, is_call, single_user, tensor_val
from ..rewrite import Candidate, check_operands

ANCHORS = (aten.mm.default, aten.addmm.default, aten.sum.dim_IntList)
NAMES = ("dequant_mm",)
_QUANT = (torch.int8, torch.float8_e4m3fn)  # what the ops take


def _dequant(node):
    """(q, scale, zero point or None) if ``node`` is ``q.to(float) * scale`` or
    ``(q.to(float) - zero_point) * scale`` with an 8-bit ``q``, else None."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for x, s in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        zp = None
        if is_call(x, aten.sub.Tensor) and not x.kwargs:
            x, zp = x.args
        if cast_dtype(x) in FLOAT_DTYPES and tensor_val(x.args[0]).dtype in QUANT_DTYPES:
            return x.args[0], s, zp
    return None


def _peel_float_cast(node):
    """The source of a float-to-float cast of the dequantized value (fp32 scales make an fp32
    product that the graph rounds to bf16; the fused op skips that rounding), else ``node``."""
    if cast_dtype(node) in FLOAT_DTYPES and tensor_val(node.args[0]).dtype in FLOAT_DTYPES:
        return node.args[0]
    return node


def _activation(A: fx.Node):
    """(q, scale, its Axis, view args or None, zero point or None) of a dequantized [M, K] A
    (or a 3-D one viewed to 2-D)."""
    view = None
    if is_call(A, *VIEW_OPS):
        view, A = A.args[1], A.args[0]
    deq = _dequant(_peel_float_cast(A))
    if deq is None:
        return None
    q, s, zp = deq
    shape = list(tensor_val(A).shape)
    axis = classify(s, shape)
    if axis not in (Axis.ROW, Axis.TENSOR):
        raise Rejected(f"activation scale {s} varies along K; only per-token or per-tensor fold out of the sum")
    if zp is not None:
        if tensor_val(q).dtype != torch.int8:
            raise Rejected("a zero point on a float8 activation; zero points are int8 only")
        if classify(zp, shape) not in (Axis.ROW, Axis.TENSOR):
            raise Rejected(f"activation zero point {describe(zp)} varies along K; only per-token or per-tensor "
                           "fold out of the sum")
    return q, s, axis, view, zp


def _weight(B: fx.Node):
    """(q, scale, its Axis on the output, transposed) of a dequantized [K, N] B, or of the
    transpose of an [N, K] one."""
    transposed = is_call(B, aten.permute.default) and list(B.args[1]) == [1, 0] or is_call(B, aten.t.default)
    outer = B.args[0] if transposed else B
    inner = _peel_float_cast(outer)
    deq = _dequant(inner)
    if deq is None:
        return None
    for node in dict.fromkeys((B, outer, inner)):  # (each once; an activation may have other users)
        if single_user(node) is None:
            raise Rejected(f"the dequantized weight {node} has {len(node.users)} users")
    q, s, zp = deq
    if zp is not None:
        raise Rejected(f"the weight has a zero point ({describe(zp)}); only activations' zero points fold out")
    axis = classify(s, list(tensor_val(inner).shape))
    if axis not in (Axis.ROW if transposed else Axis.COL, Axis.TENSOR):
        raise Rejected(f"weight scale {s} varies along K; only per-channel or per-tensor fold out of the sum")
    return q, s, Axis.TENSOR if axis is Axis.TENSOR else Axis.COL, transposed


def _unsqueezed(node, dim: int):
    """``x`` of ``x.to(float32).unsqueeze(dim)`` (or of ``x.unsqueeze(dim)``), else None. (The
    activation's, dim 2, may be shared by siblings' products, as ``_activation`` allows.)"""
    if not is_call(node, aten.unsqueeze.default) or node.args[1] != dim or dim == 0 and single_user(node) is None:
        return None
    x = node.args[0]
    if (cast_dtype(x) == torch.float32 and tensor_val(x.args[0]).dtype in FLOAT_DTYPES
            and (dim == 2 or single_user(x) is not None)):
        return x.args[0]
    return x


def _matrix_vector(node):
    """(A, B) of ``(A.float().unsqueeze(2) * B.float().unsqueeze(0)).sum(1)``: Inductor's
    decomposition of an M = 1 ``mm`` on CUDA (torch 2.11), else None."""
    if len(node.args) != 2 or list(node.args[1]) != [1] or node.kwargs:
        return None
    prod = node.args[0]
    if not is_call(prod, aten.mul.Tensor) or single_user(prod) is None:
        return None
    A, B = _unsqueezed(prod.args[0], 2), _unsqueezed(prod.args[1], 0)
    if A is None or B is None or tensor_val(A).dim() != 2 or tensor_val(B).dim() != 2:
        return None
    return A, B


def match(node, config) -> Candidate | None:
    if node.target is aten.addmm.default:
        bias, A, B = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise Rejected("addmm with beta/alpha != 1")
    elif node.target is aten.sum.dim_IntList:
        operands = _matrix_vector(node)
        if operands is None:
            return None  # a sum, not a matmul
        bias, (A, B) = None, operands
    else:
        bias, (A, B) = None, node.args[:2]
    act, wt = _activation(A), _weight(B)
    if act is None and wt is None:
        return None  # a float matmul: not a quantized one
    if act is None or wt is None:
        side = "activation" if act is None else "weight"
        raise Rejected(f"the {side} operand is not an int8/fp8 tensor dequantized by a multiply")
    (qa, sa, a_axis, a_view, zp), (qw, sw, w_axis, transposed) = act, wt
    check_operands(qa, qw, _QUANT, azp=zp is not None)
    ep = Epilogue()
    ep.add_factor(sa, a_axis)
    ep.add_factor(sw, w_axis)
    if bias is not None:
        if classify(bias, list(tensor_val(node).shape)) is not Axis.COL:
            raise Rejected(f"addmm input {bias} is not a bias vector [N]")
        ep.bias = bias
    ep = walk(node, ep)
    return Candidate("dequant_mm", node, qa, qw, ep, a_view=a_view, b_t=transposed, a_zero_point=zp)
