"""Read the elementwise chain that follows a matmul as one fused epilogue.

Starting at the accumulator, the walker follows the chain and folds each step into the
normal form the ops compute::

    out = prod(rows) * prod(cols) * prod(scalars) * (acc - azp * azp_adj) + bias

Steps it takes: casts between float dtypes (and integer -> float; a cast to a wider float
only where a step follows it or the graph returns it, see ``_rewidens``), ``clone``, views that
keep the last dim (2-D <-> 3-D around the matmul), ``mul`` by a per-tensor / per-token /
per-channel multiplier (any order, any number), one zero-point ``sub`` (int8 only), and
one bias ``add`` of an [N] vector after the scaling. The zero-point term is either
subtracted from the integer accumulator (``acc - azp_adj``, ``acc - azp[M, 1] *
azp_adj[1, N]``, int32 or int64) or, as torchao's asymmetric activations do, from the
scaled accumulator with the same scales (``acc * s - (z * s) * colsum``), which is the
same value: ``s * (acc - z * colsum)``.

The epilogue is the longest valid prefix of the chain. It ends

- where the chain goes on with an op that is not a step (a residual add of a full
  tensor, an activation, a reduction): the dequantization is whole;
- where it cannot take the next step (a value also used elsewhere, a multiplier on the
  wrong axis or another device, a zero point it cannot fold): fused in part, and
  ``Epilogue.stop`` says where and why, in user terms.

Only a shared accumulator leaves nothing to fuse (Rejected).

A block-wise matmul (``Epilogue.block_scaled``, patterns/blockwise.py) applies its scales
itself: its output is already dequantized, per-token and per-tensor multipliers after it
fold into its ``scale_a``, and a per-channel one ends the epilogue (it cannot join the
weight's per-block scales).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .graph import (
    FLOAT_DTYPES, VIEW_OPS, Axis, Rejected, aten, cast_dtype, classify, classify_or_none, describe, is_call, is_number,
    peel_expand, provably_equal, tensor_val, users, in_user_terms,
)

# Zero-point terms: integers (the op applies them exactly: in int32, or in int64 where a
# term is int64, as .sum() of an int32 tensor gives) or float32.
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass
class Epilogue:
    """The folded epilogue of one matmul (nodes of the user's graph, or Python numbers)."""

    rows: list = field(default_factory=list)  # per-token multipliers
    cols: list = field(default_factory=list)  # per-channel multipliers
    scalars: list = field(default_factory=list)  # per-tensor multipliers
    bias: fx.Node | None = None
    azp_adj: fx.Node | None = None  # an int32 / int64 / fp32 [N] (or [1, N]) term
    azp: fx.Node | None = None
    chain: list = field(default_factory=list)  # nodes consumed after the matmul, in order
    view: fx.Node | None = None  # the last view consumed: the output takes its shape
    arithmetic: bool = False  # the chain holds a cast, multiply, zero point or bias (not only views)
    stop: str = ""  # why the epilogue ended before a step it could not take ("": it did not)
    # The matmul applies 128x128 block scales itself (patterns/blockwise.py): its output is
    # already dequantized, and a per-channel factor cannot join its per-block weight scales.
    block_scaled: bool = False
    # ``acc - term`` that undoes a shift of the matmul's own operand (int_mm.py's u8s8 form),
    # consumed without becoming the zero point: it cancels exactly in int32, before any scaling.
    cancelled: fx.Node | None = None

    @property
    def scaled(self) -> bool:
        return self.block_scaled or bool(self.rows or self.cols or self.scalars)

    @property
    def factors(self) -> list:
        return [*((r, Axis.ROW) for r in self.rows), *((c, Axis.COL) for c in self.cols),
                *((s, Axis.TENSOR) for s in self.scalars)]

    def add_factor(self, arg, axis: Axis) -> None:
        {Axis.ROW: self.rows, Axis.COL: self.cols, Axis.TENSOR: self.scalars}[axis].append(arg)

    def summary(self) -> str:
        """What the fused kernel applies, in user terms (``explain``'s "fused in part" line)."""
        parts = ["the 128x128 block scales"] if self.block_scaled else []
        for kind, found in (("per-token", self.rows), ("per-channel", self.cols), ("per-tensor", self.scalars)):
            parts += [f"a {kind} scale"] * len(found)
        if self.azp_adj is not None:
            parts.append("the zero-point correction")
        if self.bias is not None:
            parts.append("the bias")
        casts = [cast_dtype(n) for n in self.chain if cast_dtype(n) is not None]
        if casts and casts[-1] in (torch.bfloat16, torch.float16):  # (not the accumulator's to float32)
            parts.append(f"the cast to {str(casts[-1]).replace('torch.', '')}")
        return "the matmul" + (" with " + ", ".join(parts) if parts else " alone")


@dataclass(frozen=True)
class Next:
    """What the node after the epilogue's current value is to it: a step it takes (``take``
    folds it in), a step it cannot take (``refused`` says why: the epilogue ends there, fused
    in part), or neither (no step: the epilogue ends before it, whole)."""

    take: Callable[[], None] | None = None
    refused: str = ""

    @property
    def is_step(self) -> bool:
        return self.take is not None or bool(self.refused)


END = Next()


def _other(node: fx.Node, cur: fx.Node):
    """The operand of a binary op that is not ``cur`` (None when both are ``cur``),
    seen through ``expand`` (torchao expands its scales to [M, N] before multiplying)."""
    a, b = node.args[0], node.args[1]
    if a is cur and b is not cur:
        return peel_expand(b)
    if b is cur and a is not cur:
        return peel_expand(a)
    return None


def _check_device(arg, device, what: str) -> None:
    if isinstance(arg, fx.Node) and not is_number(arg) and tensor_val(arg).device != device:
        raise Rejected(f"{what} ({describe(arg)}) is on {tensor_val(arg).device}, the matmul on {device} (mixed devices)")


def _source(arg):
    """The tensor a view / expand / reshape chain reads (the same values, re-laid out)."""
    while is_call(arg, aten.expand.default, aten.unsqueeze.default, *VIEW_OPS):
        arg = arg.args[0]
    return arg


_PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten._int_mm.default, aten._scaled_mm.default)


def _from_a_product(arg, depth: int = 12) -> bool:
    """Whether ``arg`` is computed from a matmul's result (or a fused op's) within ``depth``
    steps back: an activation, not a scale (a weight scale's ``reciprocal`` is one)."""
    seen, frontier = set(), [arg]
    for _ in range(depth):
        frontier = [n for n in frontier if isinstance(n, fx.Node) and n not in seen]
        if not frontier:
            return False
        seen.update(frontier)
        if any(n.op == "call_function" and (n.target in _PRODUCTS or str(n.target).startswith("fusepass."))
               for n in frontier):
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def _rewidens(cur: fx.Node, user: fx.Node) -> bool:
    """Whether ``user`` casts the float ``cur`` to a wider float: the consumer's upcast of a
    rounded value (``silu`` and RMSNorm compute a bf16 input in fp32). Where ops compute on
    the upcast value (``_computed_on``) and no step follows it, the epilogue ends before it:
    else the op would write fp32 (twice the bytes; a gate/up join at 2048 tokens writes 235 MB
    instead of 117) and drop the graph's rounding, where the cast left in the graph fuses into
    its consumers' kernel for nothing. An upcast the graph returns is taken: left alone, it
    would be a kernel of its own."""
    to, frm = cast_dtype(user), tensor_val(cur).dtype
    return to in FLOAT_DTYPES and frm in FLOAT_DTYPES and to.itemsize > frm.itemsize


def _computed_on(node: fx.Node) -> bool:
    """Whether every user of ``node`` is an op that computes on it (not the graph's output,
    nor another cast)."""
    found = users(node)
    return bool(found) and all(u.op == "call_function" and cast_dtype(u) is None for u in found)


def _integer_source(arg):
    """``x`` for ``x.to(float)`` with an integer ``x``, else None."""
    if cast_dtype(arg) in FLOAT_DTYPES and tensor_val(arg.args[0]).dtype in INT_DTYPES:
        return arg.args[0]
    return None


def _peel_float_casts(node):
    """``x`` for ``x.to(f)`` with float ``x`` and ``f`` (roundings the fused op leaves out)."""
    node = peel_expand(node)
    while cast_dtype(node) in FLOAT_DTYPES and tensor_val(node.args[0]).dtype in FLOAT_DTYPES:
        node = peel_expand(node.args[0])
    return node


def _mul_leaves(node) -> list:
    """The factors of a product tree of ``mul`` nodes (the node itself if it is none),
    through float-to-float casts."""
    node = _peel_float_casts(node)
    if is_call(node, aten.mul.Tensor, aten.mul.Scalar):
        return _mul_leaves(node.args[0]) + _mul_leaves(node.args[1])
    return [node]


class _Walker:
    def __init__(self, anchor: fx.Node, ep: Epilogue, allow_azp: bool, cancels):
        self.anchor = anchor
        self.ep = ep
        self.allow_azp = allow_azp
        self.cancels = cancels
        self.device = tensor_val(anchor).device

    def factors(self, arg, shape) -> list:
        """[(multiplier, Axis)] of a scale operand; a product of scales (``sa * sb``, an
        outer product included) is split back into its factors."""
        arg = peel_expand(arg)
        if is_number(arg):
            return [(arg, Axis.TENSOR)]
        _check_device(arg, self.device, "a multiplier")
        if isinstance(arg, fx.Node) and tensor_val(arg).dtype not in FLOAT_DTYPES:
            raise Rejected(f"a multiplier ({describe(arg)}) is not a float scale")
        try:
            return [(arg, classify(arg, shape))]
        except Rejected:
            if is_call(arg, aten.mul.Tensor) and all(isinstance(t, fx.Node) for t in arg.args[:2]):
                return self.factors(arg.args[0], shape) + self.factors(arg.args[1], shape)
            raise

    def _leads_to_a_step(self, node: fx.Node) -> bool:
        """Whether a step follows ``node``, through views and clones (which any chain may
        hold): one the epilogue takes, or one it refuses (the walk then says why it ended)."""
        found = users(node)
        while len(found) == 1 and is_call(found[0], aten.clone.default, *VIEW_OPS):
            if not self.step(node, found[0]).take:
                return False
            node, found = found[0], users(found[0])
        return len(found) == 1 and self.step(node, found[0]).is_step

    def step(self, cur: fx.Node, user: fx.Node) -> Next:
        """What ``user`` (the next node after ``cur``) is to the epilogue. Changes nothing."""
        try:
            take = self._fold(cur, user)
        except Rejected as e:
            return Next(refused=str(e))
        return END if take is None else Next(take=take)

    def _fold(self, cur: fx.Node, user: fx.Node):
        """``step``'s work: a function that folds ``user`` in, None where it is no step, or
        Rejected (from here or the helpers) where it is a step this epilogue cannot take. One
        method per kind of op; the order of the checks is the walk's rules."""
        shape = list(tensor_val(cur).shape)
        out = tensor_val(user) if isinstance(user.meta.get("val"), torch.Tensor) else None
        if out is None or len(out.shape) != len(shape) and not is_call(user, *VIEW_OPS):
            return None
        if cast_dtype(user) is not None:
            return self._fold_cast(cur, user)
        if is_call(user, aten.clone.default):
            return None if user.kwargs.get("memory_format") else _noop
        if is_call(user, *VIEW_OPS):
            return self._fold_view(cur, user, out, shape)
        if not all(provably_equal(a, b) for a, b in zip(out.shape, shape)):
            return None  # broadcasts the value up: not elementwise on it
        if is_call(user, aten.sub.Tensor) and user.args[0] is cur and user.kwargs.get("alpha", 1) == 1:
            return self.subtract(peel_expand(user.args[1]), shape)
        if out.dtype not in FLOAT_DTYPES:
            return None  # integer arithmetic (could wrap): not a dequantization step
        if is_call(user, aten.mul.Tensor, aten.mul.Scalar):
            return self._fold_mul(cur, user, shape)
        if is_call(user, aten.add.Tensor) and user.kwargs.get("alpha", 1) == 1:
            return self._fold_add(cur, user, shape)
        return None

    def _fold_cast(self, cur: fx.Node, user: fx.Node):
        """A cast: to a float, or widening int32 -> int64 (exact), a no-op step; a cast back to
        a wider float after a rounding, computed on and leading to no step, ends the walk."""
        if _rewidens(cur, user) and _computed_on(user) and not self._leads_to_a_step(user):
            return None
        widening = cast_dtype(user) == torch.int64 and tensor_val(cur).dtype == torch.int32
        return _noop if cast_dtype(user) in FLOAT_DTYPES or widening else None

    def _fold_view(self, cur: fx.Node, user: fx.Node, out, shape):
        """A view that keeps the rows' width and the elements: 2-D, or 3-D (the op's output
        viewed back)."""
        if (len(out.shape) in (2, 3) and provably_equal(out.shape[-1], shape[-1])
                and provably_equal(out.numel(), tensor_val(cur).numel())):
            return lambda: setattr(self.ep, "view", user if len(out.shape) == 3 else None)
        return None

    def _fold_mul(self, cur: fx.Node, user: fx.Node, shape):
        """A multiply by scale factors (per row, column or tensor)."""
        ep = self.ep
        other = _other(user, cur)
        if other is None:
            raise Rejected("the value is squared")
        _check_device(other, self.device, "a multiplier")  # mixed devices: never fused
        try:
            factors = self.factors(other, shape)
        except Rejected:
            if ep.scaled:
                return None  # the dequantization is complete; a different op follows
            raise
        if ep.scaled and provably_equal(shape[0], 1) and any(
                axis is Axis.COL and _from_a_product(f) for f, axis in factors):
            # At M = 1 an activation's [1, N] row reads as a column vector: the SiLU'd gate
            # times up, which would make up depend on gate and keep them from joining. Not a
            # step, as the same product at M > 1 ([M, N]) is none: the epilogue ends whole.
            return None
        if ep.bias is not None:
            raise Rejected("a multiply follows the bias add; the fused epilogue adds the bias last")
        if ep.block_scaled and any(axis is Axis.COL for _, axis in factors):
            raise Rejected("a per-channel multiply follows a block-wise matmul, whose weight scales are per "
                           "128x128 block")
        return lambda: [ep.add_factor(f, axis) for f, axis in factors]

    def _fold_add(self, cur: fx.Node, user: fx.Node, shape):
        """The bias: an [N] float vector added after the scaling (anything else ends the walk,
        e.g. a residual add)."""
        ep = self.ep
        other = _other(user, cur)
        if not ep.scaled or not isinstance(other, fx.Node):
            return None
        if classify_or_none(other, shape) is not Axis.COL or tensor_val(other).dtype not in FLOAT_DTYPES:
            return None  # e.g. a residual add: the epilogue ends before it
        if ep.bias is not None:
            raise Rejected("a second [N] vector is added; the fused epilogue adds one bias")
        _check_device(other, self.device, "the bias")
        return lambda: setattr(ep, "bias", other)

    def subtract(self, term, shape):
        """A zero-point correction ``cur - term``: before the scaling (``term`` from
        integers) or after it with the scales applied so far (torchao's asymmetric form)."""
        ep = self.ep
        core = _peel_float_casts(term)
        if classify_or_none(core, shape) is None and not is_call(core, aten.mul.Tensor):
            return None  # a full tensor: not a zero point (a residual, say)
        if not self.allow_azp:
            raise Rejected("a zero-point subtract follows a float8 matmul; zero points are int8 only")
        if (self.cancels is not None and ep.cancelled is None and not ep.scaled and ep.azp_adj is None
                and self.cancels(term)):
            return lambda: setattr(ep, "cancelled", term)
        if ep.azp_adj is not None or ep.bias is not None:
            raise Rejected("a subtract follows the zero point or the bias; the fused epilogue has one zero point")
        azp, azp_adj = self.scaled_zero_point(term, shape) if ep.scaled else self.zero_point(term, shape)
        return lambda: (setattr(ep, "azp", azp), setattr(ep, "azp_adj", azp_adj))

    def zero_point(self, term, shape):
        """``acc - term``: per-token (term is azp[M, 1] * adj[1, N]) or per-tensor (term is [N]).
        Returns (azp, azp_adj); azp is None for the per-tensor form. At one row (M = 1) a
        per-tensor zero point times [1, N] row sums is a [1, N] term too: read as per-token
        where both factors can be the op's operands, the op takes the row sums as stored
        (siblings' slices of one buffer then join) instead of a product computed every call."""
        _check_device(term, self.device, "the zero-point term")
        factors = None
        if is_call(term, aten.mul.Tensor) and all(isinstance(t, fx.Node) for t in term.args[:2]):
            factors = {classify_or_none(peel_expand(t), shape): peel_expand(t) for t in term.args[:2]}
            if Axis.TENSOR in factors and all(provably_equal(d, 1) for d in shape[:-1]):
                factors[Axis.ROW] = factors.pop(Axis.TENSOR)  # one row: a per-token zero point is one value
        per_tensor = classify_or_none(term, shape) is Axis.COL
        if factors is not None and set(factors) == {Axis.ROW, Axis.COL} and (
                not per_tensor or all(map(self.operand, factors.values()))):
            azp, azp_adj = factors[Axis.ROW], factors[Axis.COL]
        elif per_tensor:
            azp, azp_adj = None, term
        elif factors is not None:
            raise Rejected(f"the zero-point term ({describe(term)}) is not azp[M, 1] * azp_adj[1, N]")
        else:
            raise Rejected(f"the zero-point term ({describe(term)}) is neither z * colsum [N] nor azp[M, 1] * azp_adj[1, N]")
        for t in (azp, azp_adj):
            if t is not None:
                self.check_zero_point(t)
        return azp, azp_adj

    def operand(self, t) -> bool:
        """Whether ``t`` can be a zero-point operand of the op (``check_zero_point`` passes):
        a tensor on the matmul's device (not a SymInt, nor a CPU scalar), integer or fp32."""
        val = t.meta.get("val")
        return (isinstance(val, torch.Tensor) and not is_number(t) and val.device == self.device
                and val.dtype in INT_DTYPES + (torch.float32,))

    def check_zero_point(self, t) -> None:
        if tensor_val(t).dtype not in INT_DTYPES + (torch.float32,):
            raise Rejected(f"a zero-point term ({describe(t)}) is neither an integer nor a float32 tensor")
        _check_device(t, self.device, "the zero-point term")

    def scaled_zero_point(self, term, shape):
        """``acc * S - term`` with ``term = z * colsum * S`` (or ``adj * S``) and ``S`` the
        product of the scales taken so far: the zero point of ``S * (acc - z * colsum)``.
        ``z`` and ``colsum`` are integers cast to float (their integer sources become the
        op's azp / azp_adj, exact); the scales must be the same tensors as ``S``'s."""
        ints, floats = [], []
        for leaf in _mul_leaves(term):
            if is_number(leaf):
                if leaf != 1:
                    raise Rejected("the zero-point term after the scaling has a constant factor")
                continue
            _check_device(leaf, self.device, "the zero-point term")
            axis = classify(leaf, shape)
            src = _integer_source(leaf)
            (ints if src is not None else floats).append((_source(src) if src is not None else _source(leaf), axis))
        applied = [(f if is_number(f) else _source(f), axis) for f, axis in self.ep.factors]
        if sorted(map(_key, floats)) != sorted(map(_key, applied)):
            raise Rejected("a zero-point correction after the scaling is scaled differently from the accumulator")
        if all(provably_equal(d, 1) for d in shape[:-1]):  # one row: a per-token zero point is one value
            ints = [(src, Axis.ROW if axis is Axis.TENSOR else axis) for src, axis in ints]
        axes = {axis: src for src, axis in ints}
        if len(ints) == 2 and set(axes) == {Axis.ROW, Axis.COL}:
            azp, azp_adj = axes[Axis.ROW], axes[Axis.COL]
        elif len(ints) == 1 and Axis.COL in axes:
            azp, azp_adj = None, axes[Axis.COL]
        else:
            raise Rejected("a zero-point correction after the scaling is not z[M, 1] * colsum[N] (or z * colsum [N])")
        for t in (azp, azp_adj):
            if t is not None:
                self.check_zero_point(t)
        return azp, azp_adj


def _key(item) -> tuple:
    """A sortable identity of (source node or number, axis)."""
    src, axis = item
    return (axis.value, src.name if isinstance(src, fx.Node) else repr(src))


def _noop() -> None:
    pass


def _continues(walker: _Walker, cur: fx.Node, user: fx.Node) -> bool:
    """Would ``user`` be a step of the epilogue? (Asked of a value with several users.)"""
    return walker.step(cur, user).is_step


def walk(anchor: fx.Node, ep: Epilogue | None = None, *, allow_azp: bool = False, cancels=None) -> Epilogue:
    """Fold the longest valid prefix of the chain after ``anchor`` into ``ep`` (which may
    hold the matmul's own scales and bias). Returns it with ``chain`` set, and ``stop``
    where it ended at a step it could not take; raises Rejected only where nothing of the
    chain can be fused (a shared accumulator, or a first step that is refused).
    ``cancels(term)``: whether an unscaled ``acc - term`` undoes the caller's operand shift
    (recorded in ``ep.cancelled``, at most once, and no zero point)."""
    ep = ep or Epilogue()
    walker = _Walker(anchor, ep, allow_azp, cancels)
    cur = anchor
    while True:
        found = users(cur)
        if len(found) != 1:
            steps = [u for u in found if _continues(walker, cur, u)]
            if steps and cur is anchor:
                raise Rejected(f"the accumulator is used by {len(found)} ops; the fused epilogue needs it alone")
            # Casts and views of the shared value cost nothing where they stay: Inductor
            # fuses them into their consumers. Arithmetic left outside is a lost step.
            lost = [u for u in steps if cast_dtype(u) is None and not is_call(u, aten.clone.default, *VIEW_OPS)]
            if lost:
                ep.stop = f"its value is also used elsewhere, so the step {in_user_terms(lost[0])} stays outside"
            return ep
        after = walker.step(cur, found[0])
        if after.refused:
            if not ep.chain and not ep.scaled:
                raise Rejected(after.refused)
            ep.stop = f"{after.refused} ({in_user_terms(found[0])})"
            return ep
        if after.take is None:
            return ep
        after.take()
        cur = found[0]
        ep.arithmetic |= not is_call(cur, aten.clone.default, *VIEW_OPS)
        ep.chain.append(cur)
