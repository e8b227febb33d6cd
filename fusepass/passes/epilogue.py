"""Read the elementwise chain that follows a matmul as one fused epilogue.

Starting at the accumulator, the walker follows single-user nodes and folds each step
into the normal form the ops compute::

    out = prod(rows) * prod(cols) * prod(scalars) * (acc - azp * azp_adj) + bias

Steps it takes: casts between float dtypes (and int32 -> float), ``clone``, views that
keep the last dim (2-D <-> 3-D around the matmul), ``mul`` by a per-tensor / per-token /
per-channel multiplier (any order, any number), one zero-point ``sub`` before any scaling
(int8 only), and one bias ``add`` of an [N] vector after the scaling.

Where the chain goes on with an op that is not a step (a residual add, an activation,
a reduction...) the epilogue ends there, and the prefix is fused. It is rejected instead
when a mid-chain value has another user, or when a ``mul``/``sub`` is by something that is
not a valid multiplier (a full [M, N] tensor, a vector on the wrong axis, another device):
then the user's chain is not of the fused form and the graph is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .graph import (
    FLOAT_DTYPES, VIEW_OPS, Axis, Rejected, aten, cast_dtype, classify, classify_or_none, is_call, is_number, peel_expand,
    same, tensor_val, users,
)

AZP_DTYPES = (torch.int32, torch.float32)


@dataclass
class Epilogue:
    """The folded epilogue of one matmul (nodes of the user's graph, or Python numbers)."""

    rows: list = field(default_factory=list)  # per-token multipliers
    cols: list = field(default_factory=list)  # per-channel multipliers
    scalars: list = field(default_factory=list)  # per-tensor multipliers
    bias: fx.Node | None = None
    azp_adj: fx.Node | None = None
    azp: fx.Node | None = None
    chain: list = field(default_factory=list)  # nodes consumed after the matmul, in order
    view: fx.Node | None = None  # the last view consumed: the output takes its shape
    arithmetic: bool = False  # the chain holds a cast, multiply, zero point or bias (not only views)

    @property
    def scaled(self) -> bool:
        return bool(self.rows or self.cols or self.scalars)

    def add_factor(self, arg, axis: Axis) -> None:
        {Axis.ROW: self.rows, Axis.COL: self.cols, Axis.TENSOR: self.scalars}[axis].append(arg)


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
        raise Rejected(f"{what} {arg} is on {tensor_val(arg).device}, the matmul on {device} (mixed devices)")


class _Walker:
    def __init__(self, anchor: fx.Node, ep: Epilogue, allow_azp: bool):
        self.ep = ep
        self.allow_azp = allow_azp
        self.device = tensor_val(anchor).device

    def factors(self, arg, shape) -> list:
        """[(multiplier, Axis)] of a scale operand; a product of scales (``sa * sb``, an
        outer product included) is split back into its factors."""
        arg = peel_expand(arg)
        if is_number(arg):
            return [(arg, Axis.TENSOR)]
        _check_device(arg, self.device, "multiplier")
        if isinstance(arg, fx.Node) and tensor_val(arg).dtype not in FLOAT_DTYPES:
            raise Rejected(f"multiplier {arg} has dtype {tensor_val(arg).dtype}, not a float scale")
        try:
            return [(arg, classify(arg, shape))]
        except Rejected:
            if is_call(arg, aten.mul.Tensor) and all(isinstance(t, fx.Node) for t in arg.args[:2]):
                return self.factors(arg.args[0], shape) + self.factors(arg.args[1], shape)
            raise

    def step(self, cur: fx.Node, user: fx.Node):
        """How ``user`` (the next node after ``cur``) folds into the epilogue: a function
        that applies it, or None where the epilogue ends. Changes nothing itself."""
        ep = self.ep
        shape = list(tensor_val(cur).shape)
        out = tensor_val(user) if isinstance(user.meta.get("val"), torch.Tensor) else None
        if out is None or len(out.shape) != len(shape) and not is_call(user, *VIEW_OPS):
            return None
        if cast_dtype(user) is not None:
            return _noop if cast_dtype(user) in FLOAT_DTYPES else None
        if is_call(user, aten.clone.default):
            return None if user.kwargs.get("memory_format") else _noop
        if is_call(user, *VIEW_OPS):
            if len(out.shape) in (2, 3) and same(out.shape[-1], shape[-1]) and same(out.numel(), tensor_val(cur).numel()):
                return lambda: setattr(ep, "view", user if len(out.shape) == 3 else None)
            return None
        if not all(same(a, b) for a, b in zip(out.shape, shape)):
            return None  # broadcasts the value up: not elementwise on it
        if is_call(user, aten.sub.Tensor) and user.args[0] is cur and user.kwargs.get("alpha", 1) == 1:
            if not self.allow_azp or ep.scaled or ep.bias is not None or ep.azp_adj is not None:
                return None
            azp, azp_adj = self.zero_point(peel_expand(user.args[1]), shape)
            return lambda: (setattr(ep, "azp", azp), setattr(ep, "azp_adj", azp_adj))
        if out.dtype not in FLOAT_DTYPES:
            return None  # integer arithmetic (could wrap): not a dequantization step
        if is_call(user, aten.mul.Tensor, aten.mul.Scalar):
            other = _other(user, cur)
            if other is None:
                raise Rejected(f"{user} squares the accumulator")
            _check_device(other, self.device, "multiplier")  # mixed devices: never fused
            try:
                factors = self.factors(other, shape)
            except Rejected:
                if ep.scaled:
                    return None  # the dequantization is complete; a different op follows
                raise
            if ep.bias is not None:
                return None  # a multiply after the bias: fuse up to the bias
            return lambda: [ep.add_factor(f, axis) for f, axis in factors]
        if is_call(user, aten.add.Tensor) and user.kwargs.get("alpha", 1) == 1:
            other = _other(user, cur)
            if ep.bias is not None or not ep.scaled or not isinstance(other, fx.Node):
                return None
            if classify_or_none(other, shape) is not Axis.COL or tensor_val(other).dtype not in FLOAT_DTYPES:
                return None  # e.g. a residual add: the epilogue ends before it
            _check_device(other, self.device, "bias")
            return lambda: setattr(ep, "bias", other)
        return None

    def zero_point(self, term, shape):
        """``acc - term``: per-tensor (term is [N]) or per-token (term is azp[M,1] * adj[1,N]).
        Returns (azp, azp_adj); azp is None for the per-tensor form."""
        _check_device(term, self.device, "zero-point term")
        azp = None
        if classify_or_none(term, shape) is Axis.COL:
            azp_adj = term
        elif is_call(term, aten.mul.Tensor) and all(isinstance(t, fx.Node) for t in term.args[:2]):
            axes = {classify_or_none(peel_expand(t), shape): peel_expand(t) for t in term.args[:2]}
            if set(axes) != {Axis.ROW, Axis.COL}:
                raise Rejected(f"zero-point term {term} is not azp[M, 1] * azp_adj[1, N]")
            azp, azp_adj = axes[Axis.ROW], axes[Axis.COL]
        else:
            raise Rejected(f"zero-point term {term} is neither z * colsum [N] nor azp[M, 1] * azp_adj[1, N]")
        for t in (azp, azp_adj):
            if t is not None and tensor_val(t).dtype not in AZP_DTYPES:
                raise Rejected(f"zero-point term {t} has dtype {tensor_val(t).dtype}; int32 or float32 needed")
            _check_device(t, self.device, "zero-point term")
        return azp, azp_adj


def _noop() -> None:
    pass


def _continues(walker: _Walker, cur: fx.Node, user: fx.Node) -> bool:
    """Would ``user`` be a step of the epilogue? (Asked of a value with several users.)"""
    try:
        return walker.step(cur, user) is not None
    except Rejected:
        return True


def walk(anchor: fx.Node, ep: Epilogue | None = None, *, allow_azp: bool = False) -> Epilogue:
    """Fold the chain after ``anchor`` into ``ep`` (which may hold the matmul's own scales
    and bias). Returns it with ``chain`` set; raises Rejected where the graph must stay."""
    ep = ep or Epilogue()
    walker = _Walker(anchor, ep, allow_azp)
    cur = anchor
    while True:
        found = users(cur)
        if len(found) != 1:
            if any(_continues(walker, cur, u) for u in found):
                what = "the accumulator" if cur is anchor else f"mid-chain value {cur}"
                raise Rejected(f"{what} has {len(found)} users; the fused epilogue needs it alone")
            return ep
        apply = walker.step(cur, found[0])
        if apply is None:
            return ep
        apply()
        cur = found[0]
        ep.arithmetic |= not is_call(cur, aten.clone.default, *VIEW_OPS)
        ep.chain.append(cur)
