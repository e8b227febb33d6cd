"""Small FX helpers the patterns share: reading ``meta["val"]``, classifying how a tensor
broadcasts against a matmul output, and inserting nodes with fake-tensor metadata.

Every shape question is asked with ``statically_known_true`` so that symbolic sizes
(dynamic M) are compared as expressions and no guard is ever added by the pass.
"""

from __future__ import annotations

import enum
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._compat import OpOverload, detect_fake_mode, schema as op_schema

aten = torch.ops.aten
prims = torch.ops.prims

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 8-bit dtypes a quantized matmul may start from; the ops take int8 and float8_e4m3fn.
QUANT_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class Rejected(Exception):
    """A candidate the pass leaves alone; the message says why (shown by ``explain``)."""


def fake_value(arg) -> Any:
    """The fake value of a node (or the argument itself when it is a Python constant)."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def tensor_val(node) -> torch.Tensor:
    v = fake_value(node)
    if not isinstance(v, torch.Tensor):
        what = in_user_terms(node) if isinstance(node, fx.Node) else repr(node)
        raise Rejected(f"an operand {what} has no tensor metadata")
    return v


def schema_args(node: fx.Node) -> list:
    """An op call's arguments in schema order, defaults filled in."""
    schema = op_schema(node.target)
    given = list(node.args)
    return given + [node.kwargs.get(a.name, a.default_value) for a in schema.arguments[len(given):]]


_PACKAGE = Path(__file__).resolve().parents[1]  # fusepass/


def location(node: fx.Node) -> str:
    """``file:line: code`` of the innermost user frame in the node's stack trace: the user's
    code, past fusepass's own frames (a prepared linear's forward); fusepass's own where there is
    no other."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = []
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].strip()
        if head.startswith('File "'):
            path, _, rest = head[len('File "'):].partition('", line ')
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((Path(path), f"{Path(path).name}:{rest.split(',')[0]}: {code}"))
    for path, where in frames:
        if _PACKAGE not in path.resolve().parents:
            return where
    return frames[0][1] if frames else ""


def module_path(node: fx.Node) -> str:
    """``layers.0.qkv_proj``: the innermost nn.Module of Dynamo's ``nn_module_stack``, as
    ``named_modules`` spells it ("" in the compiled function itself)."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return ""
    path, cls = stack[-1]
    # The compiled object: L['self'], L['fn'], a global, or an argument of a wrapper Dynamo
    # compiles instead (L['args'][0]: a transformers 5.24 model under torch.compile).
    path = re.sub(r"^L\['(args|kwargs)'\]\[[^\]]*\]\.?|^[LG]\['[^']*'\]\.?", "", path)
    path = re.sub(r"(?:^|\.)_modules\['([^']*)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.strip(".") or getattr(cls, "__name__", str(cls))


def in_user_terms(node: fx.Node) -> str:
    """A node in user terms: its module path and source line, never its FX name."""
    mod, loc = module_path(node), location(node)
    text = " in ".join(p for p in (f"at {loc}" if loc else "", f"module {mod}" if mod else "") if p)
    return text or f"(an aten.{getattr(node.target, '__name__', node.target)} with no source line)"


def describe(arg) -> str:
    """An operand in user terms: its dtype and shape (FX names mean nothing to a user)."""
    v = fake_value(arg)
    if isinstance(v, torch.Tensor):
        return f"a {str(v.dtype).replace('torch.', '')}{list(v.shape)} tensor"
    return f"the number {v}"


def provably_equal(a, b) -> bool:
    """Whether two sizes (ints or SymInts) are equal whatever their symbols' values."""
    return statically_known_true(a == b)


def is_call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def cast_dtype(node):
    """The target dtype if ``node`` is a pure dtype cast (``convert_element_type``, or
    ``_to_copy`` with nothing but a dtype: graphs traced without decompositions), else None."""
    if is_call(node, prims.convert_element_type.default):
        return node.args[1]
    if is_call(node, aten._to_copy.default) and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def peel_views(node):
    """What ``node`` is a view of (through reshapes and views): the same elements, in order."""
    while is_call(node, *VIEW_OPS):
        node = node.args[0]
    return node


def peel_expand(arg):
    """``t`` for ``t.expand(...)``: an expanded multiplier holds the values of ``t``."""
    while is_call(arg, aten.expand.default):
        arg = arg.args[0]
    return arg


# Metadata asserts torch.export leaves on intermediates; Inductor removes them only after
# this pass (remove_assert_ops), so they are not users of a value.
ASSERT_OPS = (aten._assert_tensor_metadata.default,)


def users(node: fx.Node) -> list:
    """The users of ``node`` that consume its value (metadata asserts left out)."""
    return [u for u in node.users if not is_call(u, *ASSERT_OPS)]


def single_user(node: fx.Node) -> fx.Node | None:
    found = users(node)
    return found[0] if len(found) == 1 else None


class Axis(enum.Enum):
    """How a multiplier broadcasts against a [..., N] matmul output."""

    TENSOR = "per-tensor"  # one value
    ROW = "per-token"  # one value per row: [..., 1] matching the leading dims
    COL = "per-channel"  # one value per output column: [N] / [1, N] / [1, 1, N]


def is_number(arg) -> bool:
    """A Python number, a node holding one (SymFloat / SymInt), or a 0-d CPU tensor, which
    eager broadcasting treats as a number on any device (torch 2.11 passes a Python float
    scale that way under ``dynamic=True``)."""
    v = fake_value(arg)
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and v.device.type == "cpu"
    return isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool)


def classify(arg, out_shape) -> Axis:
    """The broadcast axis of ``arg`` (a node or Python number) against ``out_shape``.

    Raises Rejected for anything that is not one value per tensor, row or column (a full
    [M, N] tensor, or a vector that broadcasts along the wrong axis).
    """
    if is_number(arg):
        return Axis.TENSOR
    v = tensor_val(arg)
    if v.dim() > len(out_shape):
        raise Rejected(f"{describe(arg)} has more dims than the matmul output {list(out_shape)}")
    if statically_known_true(v.numel() == 1):
        return Axis.TENSOR
    shape = [1] * (len(out_shape) - v.dim()) + list(v.shape)
    lead, last = shape[:-1], shape[-1]
    if provably_equal(last, out_shape[-1]) and all(provably_equal(d, 1) for d in lead):
        return Axis.COL
    if provably_equal(last, 1) and all(provably_equal(d, o) for d, o in zip(lead, out_shape[:-1])):
        return Axis.ROW
    raise Rejected(
        f"{describe(arg)} is not per-tensor, per-token or per-channel for an output of shape {list(out_shape)}"
    )


def classify_or_none(arg, out_shape) -> Axis | None:
    """``classify``, with None where it would reject."""
    try:
        return classify(arg, out_shape)
    except Rejected:
        return None


class Inserter:
    """Inserts nodes before ``anchor`` and fills their ``meta["val"]`` by running the op
    on the fake inputs, as Inductor's own pattern replacements do. ``rollback`` removes
    them again (when the op's checks refuse the arguments)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph = graph
        self.anchor = anchor
        self.created: list[fx.Node] = []
        # (the graph's one fake mode, from its first fake value: a scan of every node per
        # rewrite made the pass quadratic in the graph)
        first = next((v for v in (n.meta.get("val") for n in graph.nodes) if isinstance(v, torch.Tensor)), None)
        self.fake_mode = detect_fake_mode([] if first is None else [first])

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def rollback(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()

    def fp32(self, node: fx.Node) -> fx.Node:
        if tensor_val(node).dtype == torch.float32:
            return node
        return self.call(prims.convert_element_type.default, node, torch.float32)

    def constant(self, value: float, device) -> fx.Node:
        return self.call(aten.full.default, [], value, dtype=torch.float32, device=device)

    def flat(self, node: fx.Node) -> fx.Node:
        """A [M] / [N] view of a per-token / per-channel tensor ([M, 1], [1, N], [B, S, 1]...)."""
        return node if tensor_val(node).dim() == 1 else self.call(aten.reshape.default, node, [-1])

    def scalar(self, arg, device, fp32: bool = True):
        """A per-tensor multiplier as a 0-d tensor (Python numbers stay numbers): fp32, or
        with ``fp32=False`` a device tensor's own dtype (a CPU scalar or a symbolic number
        becomes an fp32 device tensor either way)."""
        if not isinstance(arg, fx.Node):
            return arg
        v = fake_value(arg)
        if isinstance(v, torch.Tensor) and v.device != device:
            # A 0-d CPU scalar: broadcast it into a device tensor, as the user's own multiply
            # did (Inductor passes it to the kernel as a value: no copy, no device sync).
            return self.fp32(self.call(aten.mul.Tensor, self.constant(1.0, device), arg))
        if not isinstance(v, torch.Tensor):  # a symbolic number: materialize it on the device
            return self.call(aten.scalar_tensor.default, arg, dtype=torch.float32, device=device)
        if v.dim() != 0:
            arg = self.call(aten.reshape.default, arg, [])
        return self.fp32(arg) if fp32 else arg

    def product(self, nodes: list, device) -> fx.Node | None:
        """The product of fp32 nodes and Python numbers (None when there are none)."""
        numbers = [n for n in nodes if not isinstance(n, fx.Node)]
        tensors = [n for n in nodes if isinstance(n, fx.Node)]
        if numbers:
            tensors.append(self.constant(math.prod(numbers), device))
        if not tensors:
            return None
        out = tensors[0]
        for t in tensors[1:]:
            out = self.call(aten.mul.Tensor, out, t)
        return out


def _pure(node: fx.Node) -> bool:
    """An ATen or prims op without mutation or randomness (a custom op may hide either)."""
    t = node.target
    return (node.op == "call_function" and isinstance(t, OpOverload)
            and t.namespace in ("aten", "prims")
            and not op_schema(t).is_mutable and torch.Tag.nondeterministic_seeded not in t.tags)


def _frozen(arg, ids: dict):
    """A hashable stand-in for an argument: nodes by value id, lists as tuples, numbers with
    their type (1, 1.0 and True are equal in Python, not as arguments; nor are 0.0 and -0.0)."""
    if isinstance(arg, fx.Node):
        return ("node", ids[arg])
    if isinstance(arg, (list, tuple)):
        return tuple(_frozen(x, ids) for x in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _frozen(v, ids)) for k, v in arg.items()))
    if isinstance(arg, (bool, int, float)):
        return (type(arg).__name__, repr(arg))
    try:
        hash(arg)
        return arg
    except TypeError:
        return repr(arg)


def _meta(node: fx.Node):
    """The node's value type: dtype, shape and strides (where they are numbers)."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    return (v.dtype, repr(tuple(v.shape)), repr(v.stride()))


def value_ids(graph: fx.Graph) -> dict:
    """Node -> an id that two nodes share when they compute the same value: the same pure
    op on arguments of the same ids (hash-consing, one pass in graph order)."""
    ids, table = {}, {}
    for node in graph.nodes:
        if _pure(node):
            key = (node.target, _frozen(node.args, ids), _frozen(node.kwargs, ids), _meta(node))
            ids[node] = table.setdefault(key, len(table))
        else:
            ids[node] = table.setdefault(("node", id(node)), len(table))
    return ids
