"""Join sibling fused matmuls over touching row ranges of one weight buffer into one matmul.

Matches: 2 or more ``fusepass.scaled_mm`` (or ``scaled_mm_azp``, ``scaled_mm_blockwise``)
calls on the same activation value (and activation scale, and zero point) whose weight is
``W[lo:hi].t()`` and whose per-column operands (weight scale; row sums and bias where
present) are ``X[lo:hi]`` of one buffer each, with the same ``lo:hi`` per call (a block-wise
weight scale: ``S[lo / 128:hi / 128].t()``, its rows of 128x128 blocks), and whose ranges
touch (one call's ``hi`` is the next one's ``lo``; non-negative static bounds). This is what the siblings that
``fusepass.prepare`` puts in one buffer compute (``integrations/linear.py``): a Llama
layer's q, k and v, its gate and up.

Becomes: one call over ``W[lo_first:hi_last]``, each member's users reading its columns of
the result (``out[:, lo - lo_first:hi - lo_first]``, a view). Any M, static or symbolic.
Where the members' ``out_dtype`` differ (the epilogue walk keeps a gate projection's output
in fp32 for the SiLU after it, and its sibling's in bf16), the joined call writes fp32 and the
others' columns are rounded to theirs after it: no member loses precision.

Why: one launch instead of 2-3, and a wider one: k and v (4 MB each at Llama-3-8B's size)
alone could not reach the memory bandwidth at decode sizes; as part of q/k/v's 24 MB they do.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.fusepass.*)
from ..kernels.blockwise import BLOCK
from .graph import VIEW_OPS, Inserter, aten, is_call, peel_views, prims, schema_args, tensor_val, value_ids

fusepass = torch.ops.fusepass
NAME = "joined_siblings"
# Per op: the positions of the arguments cut along N (all but the weight: 1-D X[lo:hi]);
# the others are shared by the members.
_ROWS = {
    fusepass.scaled_mm.default: (3, 5),  # scale_b, bias
    fusepass.scaled_mm_azp.default: (3, 5, 7),  # scale_b, azp_adj, bias
    fusepass.scaled_mm_blockwise.default: (5,),  # bias
}
# Per op: the position of a block-wise weight scale, (K / 128, N / 128), cut along its dim 1.
_BLOCKS = {fusepass.scaled_mm_blockwise.default: 3}


_OUT_DTYPE = 4  # (the position of out_dtype in the three ops' schemas)


def _rows(node) -> tuple[fx.Node, int, int] | None:
    """(X, lo, hi) where ``node`` is ``X[lo:hi]`` (a step-1 slice of dim 0, static bounds)."""
    if node is None or not is_call(node, aten.slice.Tensor):
        return None
    base, dim, lo, hi, step = schema_args(node)
    size = tensor_val(base).shape[0]
    lo, hi = lo or 0, size if hi is None else hi
    if dim != 0 or step != 1 or not all(isinstance(v, int) for v in (lo, hi, size)) or min(lo, hi) < 0:
        return None  # (negative bounds count from the end: not worth normalizing here)
    return base, lo, min(hi, size)


def _peel_views(node):
    """The 1-D tensor that ``node`` (1-D) is a reshape of, through views and unsqueezes."""
    while is_call(node, *VIEW_OPS, aten.unsqueeze.default, aten.squeeze.dim) and tensor_val(node.args[0]).dim() <= 2:
        node = node.args[0]
    return node if tensor_val(node).dim() == 1 else None


def _weight_rows(b) -> tuple[fx.Node, int, int] | None:
    """(W, lo, hi) where ``b`` is ``W[lo:hi].t()`` (``t``, or a [1, 0] ``permute``)."""
    if is_call(b, aten.t.default) or (is_call(b, aten.permute.default) and list(b.args[1]) == [1, 0]):
        return _rows(b.args[0])
    return None


def _block_rows(node) -> tuple[fx.Node, int, int] | None:
    """(S, lo, hi) where ``node`` is ``S[lo:hi].t()``: transposed, or, where one of its sizes is
    1 (one row of blocks, or one 128-wide group of K), viewed to the transposed shape (what
    the block-wise pattern makes of it; the same elements in the same order)."""
    found = _weight_rows(node)
    if found is not None:
        return found
    src = peel_views(node)
    found = _rows(src) if src is not node else None
    shape, flipped = list(tensor_val(src).shape), list(tensor_val(node).shape)
    if found is None or not all(isinstance(n, int) for n in shape + flipped):  # (no guards on sizes)
        return None
    return found if len(shape) == len(flipped) == 2 and 1 in shape and shape == flipped[::-1] else None


def _member(node: fx.Node, ids: dict):
    """(key, lo, hi) of a call that can join others, or None."""
    args = schema_args(node)
    if tensor_val(args[1]).dim() != 2 or tensor_val(args[0]).dim() != 2:
        return None
    weight = _weight_rows(args[1])
    if weight is None:
        return None
    base, lo, hi = weight
    key = [node.target, base]
    for i, arg in enumerate(args):
        if i in (1, _OUT_DTYPE):
            continue
        if i == _BLOCKS.get(node.target):
            rows = _block_rows(arg)
            if rows is None or lo % BLOCK or hi % BLOCK or rows[1:] != (lo // BLOCK, hi // BLOCK):
                return None
            key.append(("blocks", rows[0]))
        elif i in _ROWS[node.target] and arg is not None:
            rows = _rows(_peel_views(arg))
            if rows is None or rows[1:] != (lo, hi) or tensor_val(arg).dim() != 1:
                return None
            key.append(("rows", rows[0]))
        else:
            key.append(("node", ids[arg]) if isinstance(arg, fx.Node) else ("const", arg))
    return tuple(key), lo, hi


def _replace(graph: fx.Graph, members: list, ranges: dict, ins: Inserter) -> None:
    """``members`` in graph order; ``ranges``: each one's (lo, hi). The joined call goes
    before the first member, whose operands (and the buffers, graph inputs) come before it,
    as every member's users come after it: the graph stays in order, with no sort (a sort per
    join made the pass quadratic in the graph: 2.1 of its 7.3 s at 32 layers)."""
    lo0, hi_n = min(r[0] for r in ranges.values()), max(r[1] for r in ranges.values())
    ins.anchor = members[0]
    args = schema_args(members[0])
    cut = lambda x: ins.call(aten.slice.Tensor, _rows(x)[0], 0, lo0, hi_n)  # noqa: E731
    new = list(args)
    new[1] = ins.call(aten.permute.default, cut(args[1].args[0]), [1, 0])
    for i in _ROWS[members[0].target]:
        if args[i] is not None:
            new[i] = cut(_peel_views(args[i]))
    if members[0].target in _BLOCKS:
        i = _BLOCKS[members[0].target]
        rows = ins.call(aten.slice.Tensor, _block_rows(args[i])[0], 0, lo0 // BLOCK, hi_n // BLOCK)
        new[i] = ins.call(aten.permute.default, rows, [1, 0])
    dtypes = {schema_args(m)[_OUT_DTYPE] for m in members}
    new[_OUT_DTYPE] = dtypes.pop() if len(dtypes) == 1 else torch.float32
    out = ins.call(members[0].target, *new)
    parts = []
    for member in members:
        lo, hi = ranges[member]
        part = ins.call(aten.slice.Tensor, out, 1, lo - lo0, hi - lo0)
        if schema_args(member)[_OUT_DTYPE] != new[_OUT_DTYPE]:
            part = ins.call(prims.convert_element_type.default, part, schema_args(member)[_OUT_DTYPE])
        part.meta["stack_trace"] = member.meta.get("stack_trace")
        parts.append(part)
    for member, part in zip(members, parts, strict=True):  # (the anchor goes last: nothing more before it)
        member.replace_all_uses_with(part)
        graph.erase_node(member)


def join_siblings(graph: fx.Graph) -> list[list[str]]:
    """Replace each run of joinable calls (module docstring) by one call; returns the names
    of the calls joined, per run."""
    calls = [n for target in _ROWS for n in graph.find_nodes(op="call_function", target=target)]
    if len(calls) < 2:
        return []
    ids = value_ids(graph)
    by_key: dict = {}
    for node in calls:
        found = _member(node, ids)
        if found is not None:
            by_key.setdefault(found[0], []).append((found[1], found[2], node))
    done = []
    position = {n: i for i, n in enumerate(graph.nodes)}  # (joins insert nodes, move none)
    ins = Inserter(graph, calls[0])
    for entries in by_key.values():
        entries.sort(key=lambda e: e[:2])
        run = [entries[0]]
        for entry in entries[1:] + [None]:
            if entry is not None and entry[0] == run[-1][1]:
                run.append(entry)
                continue
            if len(run) >= 2:
                # (none computed from another: they share their activation and the rest is
                # buffers, so a member's result reaches no other member's operands)
                nodes = sorted((e[2] for e in run), key=position.__getitem__)
                done.append([n.name for n in nodes])
                _replace(graph, nodes, {e[2]: e[:2] for e in run}, ins)
            run = [entry]
    return done
