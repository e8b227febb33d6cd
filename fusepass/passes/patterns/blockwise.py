"""Block-wise fp8 (DeepSeek-V3's recipe: one scale per 1x128 group of the activation, one per
128x128 block of the weight), in two forms.

1. ``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)`` in its block-wise mode
   (``scale_a`` [M, ceil(K/128)], ``scale_b`` [ceil(K/128), ceil(N/128)], any strides) and,
   where the installed torch has it (2.12+), ``torch.nn.functional.scaled_mm``
   (``aten._scaled_mm_v2``) with the recipes BlockWise1x128 / BlockWise128x128, no swizzle
   (cuBLAS's ``scale_b`` pads the K blocks to a multiple of 4: sliced back); then any
   epilogue (``epilogue.walk``: bias, casts, views, per-tensor and per-token multiplies,
   which fold into ``scale_a``; a per-channel multiply ends it). On CUDA under the fp8 rule
   of the ``scaled_mm`` pattern (a static M <= ``PassConfig.fp8_max_m``; cuBLAS keeps the
   rest), except a ``_scaled_mm`` whose ceil(K/128) is not a multiple of 4, which cuBLAS
   gets wrong: fused at every M; on CPU at every M (CPU ``_scaled_mm`` has no block-wise
   mode: only fused it runs).
2. Dequantize, then a float matmul: ``aten.mm`` / ``aten.addmm`` (``x @ w.t()``,
   ``F.linear``, also of 3-D ``x``) of

       A = a_q.to(f) * S_a          S_a: scale_a [..., ceil(K/128)] over 128-wide groups of K
       B = (w_q.to(f) * S_w).t()    S_w: w_scale [ceil(N/128), ceil(K/128)] over 128x128 blocks

   with the groups spread by ``repeat_interleave(128, d)``, ``unsqueeze/expand/reshape``, or
   a broadcast against a grouped view (``x.view(M, -1, 128) * s[..., None]``), sliced to a
   ragged K or N (``patterns/layout.py`` reads them); a per-token ``S_a`` (or a per-tensor one
   at M = 1) or a per-tensor ``S_w`` may stand where the other operand is blocked. Then any
   epilogue.

Both become ``fusepass.scaled_mm_blockwise(a_q, b_q, scale_a, scale_b, out_dtype, bias)``
(plus a view back to 3-D), the scales rearranged by views (``w_scale.t()``) where needed.
A dequantized matmul with no scale varying along K or in blocks along N is left to
``dequant_mm`` (None). Rejected, with the reason: groups other than 128 (or too few or too
many of them), an activation scale shared by several rows (128x128 activation blocks), a
weight scale per output channel within a block (1x128 weight groups), a scale varying per
element, int8 or e5m2 operands, a dequantized weight with other users (an activation may have
others: its dequantization stays for them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ...ops.checks import BLOCK, blocks
from . import layout
from ..epilogue import Epilogue, walk
from ..graph import (
    FLOAT_DTYPES, QUANT_DTYPES, VIEW_OPS, Axis, Inserter, Rejected, aten, cast_dtype, classify, classify_or_none,
    describe, is_call, provably_equal, tensor_val, users,
)
from ..rewrite import Candidate, check_operands
from . import scaled_mm_args

ANCHORS = scaled_mm_args.ANCHORS + (aten.mm.default, aten.addmm.default)
NAMES = ("scaled_mm_blockwise", "dequant_mm_blockwise")
_SCALING = getattr(torch.nn.functional, "ScalingType", None)  # with _scaled_mm_v2
_BLOCK_1x128, _BLOCK_128x128 = (int(_SCALING.BlockWise1x128), int(_SCALING.BlockWise128x128)) if _SCALING else (4, 5)
FP8 = (torch.float8_e4m3fn,)


@dataclass
class BlockwiseCandidate(Candidate):
    """A matmul that becomes ``fusepass.scaled_mm_blockwise``; ``scale_a`` / ``scale_b`` insert
    its [M, ceil(K/128)] / [ceil(K/128), ceil(N/128)] scales."""

    scale_a: Callable = None
    scale_b: Callable = None

    @property
    def op_name(self) -> str:
        return "fusepass.scaled_mm_blockwise"

    def insert_op(self, ins: Inserter, a, b, out_dtype, device) -> fx.Node:
        ep = self.ep
        sa, sb = self.scale_a(ins), self.scale_b(ins)
        # Per-token and per-tensor factors of the epilogue scale every group of their row alike.
        factor = ins.product([ins.fp32(ins.flat(r)) for r in ep.rows] + [ins.scalar(s, device) for s in ep.scalars],
                             device)
        if factor is not None:
            sa = ins.call(aten.mul.Tensor, sa, ins.call(aten.reshape.default, factor, [-1, 1]) if ep.rows else factor)
        bias = None if ep.bias is None else ins.flat(ep.bias)
        return ins.call(torch.ops.fusepass.scaled_mm_blockwise.default, a, b, sa, sb, out_dtype, bias)


def _fp32(node: fx.Node, rows=None):
    """A scale builder: ``node`` (fp32), its first ``rows`` rows where given."""
    def build(ins: Inserter) -> fx.Node:
        out = node if rows is None else ins.call(aten.slice.Tensor, node, 0, 0, rows)
        return ins.fp32(out)
    return build


def match(node, config) -> Candidate | None:
    if node.target in (aten.mm.default, aten.addmm.default):
        return _match_dequant(node, config)
    return _match_scaled_mm(node, config)


# --- torch._scaled_mm / F.scaled_mm ------------------------------------------------------


def _scaled_mm_args(node) -> dict | None:
    """The arguments (by ``_scaled_mm``'s names) of a 1x128 x 128x128 block-wise scaled matmul,
    with ``scale_b_rows`` the rows of ``scale_b`` to keep; None for another recipe."""
    args = scaled_mm_args.arguments(node)
    va, vb = tensor_val(args["self"]), tensor_val(args["mat2"])
    M, K, N = va.shape[0], va.shape[1], vb.shape[1]
    kb, nb = blocks(K), blocks(N)
    if node.target is aten._scaled_mm.default:  # the recipe is read off the scales' shapes
        sa, sb = tensor_val(args["scale_a"]), tensor_val(args["scale_b"])
        shapes = sa.dim() == 2 and sb.dim() == 2 and all(map(provably_equal, (*sa.shape, *sb.shape), (M, kb, kb, nb)))
        # A single block is per-token x per-tensor scaling: the scaled_mm pattern's.
        if not shapes or (provably_equal(kb, 1) and provably_equal(nb, 1)):
            return None
        args["scale_b_rows"] = None
        return args
    if (args["recipe_a"], args["recipe_b"]) != ([_BLOCK_1x128], [_BLOCK_128x128]) or None in (args["scale_a"],
                                                                                              args["scale_b"]):
        return None
    if provably_equal(tensor_val(args["scale_b"]).shape[0], kb):
        args["scale_b_rows"] = None
    elif is_concrete_int(kb):  # cuBLAS pads scale_b's K blocks to a multiple of 4
        args["scale_b_rows"] = int(kb)
    else:
        raise Rejected(f"F.scaled_mm with a padded scale_b and a symbolic K ({K})")
    return args


def _match_scaled_mm(node, config) -> Candidate | None:
    args = _scaled_mm_args(node)
    if args is None:
        return None
    a, b = args["self"], args["mat2"]
    check_operands(a, b, FP8)
    if args.get("scale_result") is not None:
        raise Rejected("torch._scaled_mm with scale_result (fp8 output) is not fused")
    out = tensor_val(node)
    M, K = out.shape[0], tensor_val(a).shape[1]
    # torch._scaled_mm's block-wise GEMM is wrong, without an error, where ceil(K/128) is not a
    # multiple of 4 (torch 2.11, H200: 14-31% of sum |a*b|): fused
    # at every M there.
    cublas_wrong = node.target is aten._scaled_mm.default and is_concrete_int(K) and blocks(int(K)) % 4 != 0
    if out.device.type == "cuda" and not cublas_wrong:
        scaled_mm_args.check_fp8_m(M, config)
    ep = walk(node, Epilogue(bias=args.get("bias"), block_scaled=True))
    return BlockwiseCandidate("scaled_mm_blockwise", node, a, b, ep, scale_a=_fp32(args["scale_a"]),
                              scale_b=_fp32(args["scale_b"], args["scale_b_rows"]))


# --- dequantize, then matmul -------------------------------------------------------------


@dataclass
class _Operand:
    """A dequantized matmul operand X [R, C] = post(q.to(f) * S): the quantized data ``q``, the
    source of ``S`` and its layout over X's two dims, ``q``'s view to X's (untransposed) shape,
    whether X is that transposed, and the nodes between ``q`` and X (a weight's must have no other
    user)."""

    q: fx.Node
    scale: fx.Node
    dims: list
    view: list | None
    transposed: bool
    chain: list  # ..., the multiply; its other operand is the spread scale
    spread: fx.Node

    @property
    def plain(self) -> bool:
        """A scale the multiply broadcasts by itself, per row / column / tensor (by its shape):
        what the dequant_mm pattern reads."""
        return classify_or_none(self.spread, list(tensor_val(self.chain[-1]).shape)) is not None


def _quantized(x):
    """``q`` of ``q.to(f)`` (through views and clones, either side of the cast) with an 8-bit ``q``."""
    cast = False
    while True:
        if cast_dtype(x) in FLOAT_DTYPES and not cast:
            cast, x = tensor_val(x.args[0]).dtype in QUANT_DTYPES, x.args[0]
            if not cast:
                return None
        elif is_call(x, aten.clone.default, *VIEW_OPS):
            x = x.args[0]
        else:
            return x if cast else None


def _same_shape(x, y) -> bool:
    return len(x) == len(y) and all(map(provably_equal, x, y))


def _operand(X) -> _Operand | None:
    post, node = [], X
    while is_call(node, aten.clone.default, aten.permute.default, *VIEW_OPS) or (
            cast_dtype(node) in FLOAT_DTYPES and tensor_val(node.args[0]).dtype in FLOAT_DTYPES):
        post.append(node)
        node = node.args[0]
    if not is_call(node, aten.mul.Tensor):
        return None
    shape = tensor_val(node).shape
    for data, scale in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        q = _quantized(data) if isinstance(scale, fx.Node) else None
        if q is not None and _same_shape(tensor_val(data).shape, shape):
            break
    else:
        return None
    src, dims = layout.trace(scale)
    dims = layout.broadcast(dims, shape)
    for n in reversed(post):
        dims = None if dims is None else layout.step(n, dims)
    permutes = [n for n in post if is_call(n, aten.permute.default)]
    if dims is None or len(dims) != 2 or permutes[1:] or (permutes and (post[0] is not permutes[0]
                                                                        or list(permutes[0].args[1]) != [1, 0])):
        return None  # a layout the analysis does not follow, or a transpose inside the chain
    flat = tensor_val(permutes[0].args[0] if permutes else X).shape  # X before its transpose
    view = None
    if not _same_shape(tensor_val(q).shape, flat):
        views = [n for n in post if is_call(n, *VIEW_OPS)]
        if not views:
            return None
        view = views[0].args[1]  # the outermost view's own shape arguments (they may hold size nodes)
    return _Operand(q, src, dims, view, bool(permutes), [*post, node], scale)


def _kind(dim: layout.Dim) -> tuple:
    """How a scale varies along one dim of a matmul operand: ("const",), ("block", src dim)
    (128-wide groups), ("groups", words) (other groups), ("each", src dims) (one value per
    index), or ("other", words)."""
    atoms = dim.atoms
    if all(a.src is None for a in atoms):
        return ("const",)
    if len(atoms) == 2 and atoms[0].src is not None and atoms[1].src is None:
        if provably_equal(atoms[1].size, BLOCK) and provably_equal(atoms[0].size, blocks(dim.size)):
            return ("block", atoms[0].src)
        return ("groups", f"is in {atoms[0].size} groups of {atoms[1].size}")
    if all(a.src is not None for a in atoms) and dim.full:
        return ("each", tuple(a.src for a in atoms))
    return ("other", "repeats in another pattern than 128-wide groups")


def _say(kind: tuple) -> str:
    return "varies per element" if kind[0] == "each" else kind[1]


def _arrange(src: fx.Node, dims: tuple, shape: list) -> Callable:
    """A scale builder: ``src`` rearranged to ``shape``, its dim i merging the source dims
    ``dims[i]`` in order (() where the scale is constant along it: expanded). Every source dim
    of size > 1 must appear once (else Rejected: a sliced or re-used scale)."""
    sizes = list(tensor_val(src).shape)
    keep = [d for d, n in enumerate(sizes) if not provably_equal(n, 1)]
    used = [d for group in dims for d in group]
    if sorted(used) != keep:
        raise Rejected(f"the scale {describe(src)} is not read whole, once per block")

    def build(ins: Inserter) -> fx.Node:
        t = src
        if len(keep) != len(sizes):
            t = ins.call(aten.reshape.default, t, [sizes[d] for d in keep])
        order = [keep.index(d) for d in used]
        if order != sorted(order):
            t = ins.call(aten.permute.default, t, order)
        merged = [-1 if n == -1 and group else math.prod(sizes[d] for d in group) for n, group in zip(shape, dims)]
        have = tensor_val(t).shape
        if len(have) != len(merged) or not all(m == -1 or provably_equal(h, m) for h, m in zip(have, merged)):
            t = ins.call(aten.reshape.default, t, merged)
        if any(not group and n != -1 and n != 1 for n, group in zip(shape, dims)):
            t = ins.call(aten.expand.default, t, shape)
        return ins.fp32(t)
    return build


def _scale_a(act: _Operand, M, kb) -> Callable:
    (rows, k) = (_kind(d) for d in act.dims)
    if k[0] not in ("block", "const"):
        raise Rejected(f"the activation scale ({describe(act.scale)}) {_say(k)}"
                       " along K; block-wise activation scales are per 128-wide group of K (1x128)")
    if rows[0] != "each" and not provably_equal(M, 1):
        raise Rejected(f"the activation scale ({describe(act.scale)}) is shared by several rows; block-wise activation "
                       "scales are per row and 128-wide group of K (1x128)")
    row_dims = rows[1] if rows[0] == "each" else ()
    return _arrange(act.scale, (row_dims, (k[1],) if k[0] == "block" else ()), [-1, kb])


def _scale_b(wt: _Operand, kb, nb) -> Callable:
    (k, n) = (_kind(d) for d in wt.dims)
    for kind, along in ((k, "K"), (n, "N")):
        if kind[0] == "each" and along == "N":
            raise Rejected(f"the weight scale ({describe(wt.scale)}) is per output channel within a block (1x128 weight "
                           "groups); the block-wise op takes one scale per 128x128 block")
        if kind[0] not in ("block", "const"):
            raise Rejected(f"the weight scale ({describe(wt.scale)}) {_say(kind)}"
                           f" along {along}; block-wise weight scales are per 128x128 block")
    return _arrange(wt.scale, tuple((kind[1],) if kind[0] == "block" else () for kind in (k, n)), [kb, nb])


def _match_dequant(node, config) -> Candidate | None:
    if node.target is aten.addmm.default:
        bias, A, B = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
    else:
        bias, (A, B) = None, node.args[:2]
    act, wt = _operand(A), _operand(B)
    if act is None or wt is None:
        return None
    if act.plain and wt.plain and not any(_kind(d)[0] in ("block", "groups") for d in (*act.dims, *wt.dims)):
        return None  # per-token / per-channel / per-tensor scales, broadcast by the multiply: dequant_mm's
    (M, K), N = tensor_val(A).shape, tensor_val(B).shape[1]
    if not (is_concrete_int(K) and is_concrete_int(N)):
        raise Rejected(f"a block-wise matmul with a symbolic K or N ({K}, {N})")
    scale_a, scale_b = _scale_a(act, M, blocks(int(K))), _scale_b(wt, blocks(int(K)), blocks(int(N)))
    for q in (act.q, wt.q):
        if tensor_val(q).dtype not in FP8:
            raise Rejected(f"block-wise scales on {tensor_val(q).dtype} operands; the block-wise op takes float8_e4m3fn")
    if wt.view is not None:
        raise Rejected(f"the quantized weight ({describe(wt.q)}) is viewed to another shape before its dequantization")
    if act.transposed:  # the op takes a [M, K] activation; emit has no transpose for it
        raise Rejected(f"the dequantized activation is transposed ({describe(act.q)} read as its .t())")
    for link in wt.chain:  # (an activation may have other users: dequant_mm.py says why)
        if len(users(link)) != 1:
            raise Rejected(f"the dequantized weight ({describe(link)}) has {len(users(link))} users")
    check_operands(act.q, wt.q, FP8)
    ep = Epilogue(block_scaled=True)
    if bias is not None:
        if classify(bias, list(tensor_val(node).shape)) is not Axis.COL:
            raise Rejected(f"addmm input {describe(bias)} is not a bias vector [N]")
        ep.bias = bias
    ep = walk(node, ep)
    return BlockwiseCandidate("dequant_mm_blockwise", node, act.q, wt.q, ep, a_view=act.view, b_t=wt.transposed,
                              scale_a=scale_a, scale_b=scale_b)
