"""Which element of a small tensor each element of a larger one reads, when the larger is made
from the smaller by layout ops only: the analysis behind block-wise scales written as
``s.repeat_interleave(128, 0)`` (which Inductor decomposes to unsqueeze, expand, clone,
view), ``s[:, None].expand(-1, 128).reshape(...)``, a broadcast against a grouped view
``x.view(M, -1, 128) * s[..., None]``, and a slice to a ragged size.

Each dim of a value is a list of *atoms*, most significant first: ``Atom(d, n)`` steps through
dim ``d`` of the source (n = its size), ``Atom(None, n)`` repeats (a broadcast of n). Index i
of the dim is read in mixed radix, one digit per atom: ``[Atom(0, 3), Atom(None, 128)]`` reads
source row ``i // 128``; ``[Atom(None, 2), Atom(0, 3)]`` reads row ``i % 3`` (a tiling). Atoms
of size 1 are dropped (their digit is always 0). A dim sliced to its first ``size`` elements
keeps its atoms (the digits of its indices do not change). Sizes may be SymInts; every
comparison is ``statically_known_true``, so the analysis adds no guards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph import FLOAT_DTYPES, VIEW_OPS, aten, cast_dtype, is_call, provably_equal, tensor_val


@dataclass(frozen=True)
class Atom:
    src: int | None  # the source dim it steps through; None: a broadcast
    size: object


@dataclass(frozen=True)
class Dim:
    atoms: tuple
    size: object  # <= the product of the atoms' sizes; less where sliced

    @property
    def full(self) -> bool:
        return provably_equal(self.size, math.prod(a.size for a in self.atoms))


def _one(n) -> bool:
    return statically_known_true(n == 1)


def _atoms(*atoms) -> tuple:
    return tuple(a for a in atoms if not _one(a.size))


def source(shape) -> list:
    return [Dim(_atoms(Atom(d, n)), n) for d, n in enumerate(shape)]


def _expand(lay: list, sizes) -> list | None:
    """``lay`` broadcast to ``sizes`` (size-1 dims repeat; new leading dims are broadcasts)."""
    lead = len(sizes) - len(lay)
    if lead < 0:
        return None
    out = [Dim(_atoms(Atom(None, n)), n) for n in sizes[:lead]]
    for dim, n in zip(lay, sizes[lead:]):
        if provably_equal(n, dim.size):
            out.append(dim)
        elif _one(dim.size):
            out.append(Dim(_atoms(Atom(None, n)), n))
        else:
            return None
    return out


def _groups(old: list, new: list) -> list | None:
    """Pairs (old dims, new dims) of equal size products, size-1 dims left out; None where the
    sizes cannot be matched statically."""
    o = [i for i, n in enumerate(old) if not _one(n)]
    w = [j for j, n in enumerate(new) if not _one(n)]
    groups, i, j = [], 0, 0
    while i < len(o) and j < len(w):
        gi, gj, pi, pj = [o[i]], [w[j]], old[o[i]], new[w[j]]
        i, j = i + 1, j + 1
        while not provably_equal(pi, pj):  # grow the side whose product divides the other's
            if statically_known_true(pi % pj == 0) and j < len(w):
                gj.append(w[j])
                pj, j = pj * new[w[j]], j + 1
            elif statically_known_true(pj % pi == 0) and i < len(o):
                gi.append(o[i])
                pi, i = pi * old[o[i]], i + 1
            else:
                return None
        groups.append((gi, gj))
    return groups if i == len(o) and j == len(w) else None


def _split(atoms: list, sizes: list) -> list | None:
    """Cut a row of atoms into dims of ``sizes``; a broadcast may be cut, a source dim not."""
    atoms, out = list(atoms), []
    for n in sizes:
        taken, p = [], 1
        while not provably_equal(p, n):
            if not atoms:
                return None
            a = atoms.pop(0)
            if statically_known_true((n // p) % a.size == 0):
                taken.append(a)
                p *= a.size
            elif a.src is None and isinstance(a.size, int) and isinstance(n // p, int) and a.size % (n // p) == 0:
                taken.append(Atom(None, n // p))
                atoms.insert(0, Atom(None, a.size // (n // p)))
                p = n
            else:
                return None
        out.append(Dim(tuple(taken), n))
    return out


def _view(lay: list, shape) -> list | None:
    groups = _groups([d.size for d in lay], list(shape))
    if groups is None:
        return None
    out = [Dim((), n) for n in shape]
    for gi, gj in groups:
        if len(gi) == 1 and len(gj) == 1:
            out[gj[0]] = lay[gi[0]]  # unchanged (and may stay sliced)
            continue
        if not all(lay[i].full for i in gi):
            return None
        dims = _split([a for i in gi for a in lay[i].atoms], [shape[j] for j in gj])
        if dims is None:
            return None
        for j, dim in zip(gj, dims):
            out[j] = dim
    return out


def _slice(lay: list, dim: int, start, end, step) -> list | None:
    if start not in (0, None) or step != 1 or not (end is None or statically_known_true(end >= 0)):
        return None
    d = lay[dim]
    size = d.size if end is None or statically_known_true(end >= d.size) else end
    return lay[:dim] + [Dim(d.atoms, size)] + lay[dim + 1:]


def _is_layout_op(node) -> bool:
    return is_call(node, aten.clone.default, aten.unsqueeze.default, aten.expand.default, aten.permute.default,
                   aten.slice.Tensor, *VIEW_OPS) or (
        cast_dtype(node) in FLOAT_DTYPES and tensor_val(node.args[0]).dtype in FLOAT_DTYPES)


def step(node: fx.Node, lay: list) -> list | None:
    """The layout after the layout op ``node`` reading a value of layout ``lay``; None where the
    analysis cannot follow it (a view that would split a source dim, a negative slice end...)."""
    shape = list(tensor_val(node).shape)
    if is_call(node, aten.unsqueeze.default):
        d = node.args[1] % (len(lay) + 1)
        return lay[:d] + [Dim((), 1)] + lay[d:]
    if is_call(node, aten.expand.default):
        return _expand(lay, shape)
    if is_call(node, *VIEW_OPS):
        return _view(lay, shape)
    if is_call(node, aten.permute.default):
        return [lay[d % len(lay)] for d in node.args[1]]
    if is_call(node, aten.slice.Tensor):
        # (a symbolic bound is a size node in the graph: its SymInt is what compares)
        args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args[1:]]
        args += [0, None, None, 1][len(args):]
        return _slice(lay, args[0] % len(lay), args[1], args[2], args[3])
    return lay  # clone, float-to-float cast: the same values


def _reads_whole(shape, lay: list) -> bool:
    """Whether a value of layout ``lay`` reads every element of its source (of ``shape``): each
    source dim of size > 1 is in a dim whose indices i < S reach every combination of its
    source atoms' digits: the smallest index with each at its largest, the sum of
    ``(n - 1) * inner`` over them (``inner``: the sizes of the atoms after it), is below S."""
    whole = set()
    for dim in lay:
        inner, reach = 1, 0
        for a in reversed(dim.atoms):
            if a.src is not None:
                reach = reach + (a.size - 1) * inner
            inner = inner * a.size
        if dim.full or statically_known_true(dim.size > reach):
            whole.update(a.src for a in dim.atoms if a.src is not None)
    return all(d in whole for d, n in enumerate(shape) if not _one(n))


def trace(node: fx.Node) -> tuple[fx.Node, list]:
    """(source, layout of ``node`` over it): back through layout ops to a source (any tensor: a
    placeholder, a computed scale) from which the analysis can follow every op up to ``node``
    (sound: the layout of any tensor over itself is the identity); of those before ``node``
    itself (whose identity layout says nothing), the farthest back that ``node`` reads whole,
    else the farthest. (A slice to a ragged size keeps its source; a slice of a buffer's first
    rows, ``s[:m].repeat_interleave(128, 1)`` or a joined buffer's first member's
    ``blocks[:1]...``, is the source itself: the buffer is read only in part. A scale with
    groups that ``node`` does not reach keeps its source, which the error messages name.)"""
    chain = [node]
    while _is_layout_op(chain[-1]):
        chain.append(chain[-1].args[0])
    chain.reverse()  # (the source candidates, farthest first)
    farthest = None
    for start, src in enumerate(chain):
        lay = source(tensor_val(src).shape)
        for n in chain[start + 1:]:
            lay = step(n, lay)
            if lay is None:
                break
        else:
            if src is not node and _reads_whole(tensor_val(src).shape, lay):
                return src, lay
            farthest = farthest or (src, lay)
    return farthest  # (node itself at the latest: its own identity layout reads it whole)


def broadcast(lay: list, shape) -> list | None:
    """The layout of a value of layout ``lay`` broadcast to ``shape`` (an elementwise op's)."""
    return _expand(lay, list(shape))
