"""Lower the fusepass op calls in a graph to what they run, so Inductor compiles them.

The rewrite leaves ``fusepass.scaled_mm`` / ``scaled_mm_azp`` / ``int_mm`` calls in
Inductor's post-grad graph. Left as they are, Inductor calls them through the dispatcher and
Python on every run (93 us of host time a call on an H200). Here each call is
replaced by the trace of its implementation (``fusepass.ops.scaled_mm.IMPLS``, the body of
the ``triton_op``):

- on CUDA: ``torch.empty`` outputs and ``triton_kernel_wrapper_mutation`` nodes writing
  them (and, for a symbolic M, a ``cond`` per M bucket; see ``fusepass.kernels.launch``),
  which Inductor compiles and launches from its own generated code, as it does its own
  kernels. This is the form Inductor's own reinplacing leaves a triton_op in, at the end of
  its post-grad passes; traced functionalized instead, a ``cond`` branch (which misses
  those passes: Inductor runs them on subgraphs before the main graph) would keep a copy
  of each output. No pass after this one removes dead code, which would drop these
  mutations (they return nothing);
- on CPU: the reference's ATen ops, which Inductor fuses into its C++ kernels (and which an
  AOTInductor package then holds, with no Python op to call back).

The config choice and the input checks run here, at trace time, once per signature: calls
with the same operand layouts and arguments (a model's layers) share one trace, each copy with
fake values of its own. Inductor then analyses each launch's kernel for the arguments it
writes; ``fusepass._compat`` has it do so once per kernel signature too.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from .._compat import detect_fake_mode, enable_python_dispatcher, inductor_decompositions, memoize_kernel_analysis
from ..kernels import KERNELS
from ..kernels.launch import INTERPRETED
from ..kernels.policy import GRAPH_SYMBOLS
from ..ops.registry import IMPLS
from .graph import schema_args

log = logging.getLogger("fusepass.pass")


def _symbol_source(graph: fx.Graph, symbol) -> fx.Node | None:
    """A node of ``graph`` whose value is ``symbol``: a SymInt placeholder, or a new
    ``sym_size`` of a placeholder with that size; None where no input has it."""
    placeholders = graph.find_nodes(op="placeholder")
    for p in placeholders:
        val = p.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr == symbol:
            return p
    for p in placeholders:
        val = p.meta.get("val")
        for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                with graph.inserting_after(placeholders[-1]):
                    node = graph.call_function(torch.ops.aten.sym_size.int, (p, dim))
                node.meta["val"] = size
                return node
    return None


def _tensors(args: list) -> list[fx.Node]:
    """The tensor arguments of an op call, list ones (scaled_mm_group's) flattened."""
    return [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, fx.Node)]


def _signature(node: fx.Node, args: list):
    """What ``node``'s trace depends on, hashable: the op, each tensor's size, strides, storage
    offset (alignment), dtype and device, every other argument's value, and which tensor
    arguments are one value (``make_fx`` given one value twice reads it from one placeholder:
    ``op(x, s, s)``'s trace must not serve ``op(x, s, t)``). None where a size is symbolic (a
    trace that holds size symbols, or a ``cond``, is not reused)."""
    def describe(a):
        if isinstance(a, (list, tuple)):
            return tuple(map(describe, a))
        if isinstance(a, fx.Node):
            t = a.meta["val"]
            sizes = (*t.shape, *t.stride(), t.storage_offset())
            if not all(isinstance(v, int) for v in sizes):
                raise TypeError
            return ("tensor", sizes, t.dtype, t.device)
        hash(a)
        return ("value", a)
    values = [id(t.meta["val"]) for t in _tensors(args)]
    try:
        return (node.target, tuple(map(describe, args)), tuple(map(values.index, values)))
    except TypeError:
        return None


def _trace(node: fx.Node, args: list, impl) -> tuple[fx.GraphModule, list] | None:
    """The trace of ``node``'s implementation on its arguments' fake values, and the
    graph nodes its placeholders stand for: the tensor arguments, then the size symbols
    they hold (see ``GRAPH_SYMBOLS``). None where a symbol has no source in the graph.
    ``args``: ``node``'s schema arguments; ``impl``: what it is replaced by."""
    tensors = _tensors(args)
    fakes = [t.meta["val"] for t in tensors]
    symbols = sorted(set().union(*map(free_symbols, fakes)), key=str)
    sources = [_symbol_source(node.graph, s) for s in symbols]
    if None in sources:
        return None
    symints = [s.meta["val"] for s in sources]

    def fn(*values):
        it = iter(values[:len(tensors)])
        take = lambda a: next(it) if isinstance(a, fx.Node) else a  # noqa: E731
        token = GRAPH_SYMBOLS.set(values[len(tensors):])
        try:
            return impl(*[[take(x) for x in a] if isinstance(a, (list, tuple)) else take(a) for a in args])
        finally:
            GRAPH_SYMBOLS.reset(token)

    with detect_fake_mode(fakes), enable_python_dispatcher():
        gm = make_fx(fn, inductor_decompositions(), tracing_mode="real")(*fakes, *symints)
    return gm, tensors + sources


def _refresh(copied: list[fx.Node]) -> None:
    """New fake values for the copies of a reused trace, computed from their inputs' (each
    site's own outputs: a later pass tells buffers apart by their fake storages). Values that
    hold no tensor (a launch's None) stay as they are."""
    def holds_tensor(v) -> bool:
        if isinstance(v, (list, tuple, dict)):
            return any(map(holds_tensor, v.values() if isinstance(v, dict) else v))
        return isinstance(v, torch.Tensor)

    changing = [n for n in copied if n.op == "call_function" and holds_tensor(n.meta.get("val"))]
    mode = detect_fake_mode([n.meta["val"] for n in changing])
    if mode is None:
        return
    with mode:
        for n in changing:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            n.meta["val"] = n.target(*args, **kwargs)


def _splice(graph: fx.Graph, node: fx.Node, gm: fx.GraphModule, inputs: list, reused: bool = False,
            keep_meta: tuple = ()) -> None:
    """Put ``gm``'s nodes in place of ``node`` (its subgraphs, e.g. cond branches, become
    submodules of the graph's module) and reroute ``node``'s users to its output;
    ``reused``: ``gm`` was traced for another call of the same signature (``_refresh``);
    ``keep_meta``: the keys of ``node``'s meta every new node takes (where it came from).
    """
    root = graph.owning_module
    for sub in gm.graph.find_nodes(op="get_attr"):
        i = 0
        while hasattr(root, f"fusepass_{sub.target}_{i}"):
            i += 1
        module, sub.target = getattr(gm, sub.target), f"fusepass_{sub.target}_{i}"
        root.register_module(sub.target, module)
    placeholders = gm.graph.find_nodes(op="placeholder")
    copies = dict(zip(placeholders, inputs))
    with graph.inserting_before(node):
        out = graph.graph_copy(gm.graph, copies)
    new = [copies[n] for n in gm.graph.nodes if n.op == "call_function"]
    if reused:
        _refresh(new)
    for n in new:
        n.meta.update({k: node.meta[k] for k in keep_meta if k in node.meta})
    if isinstance(out, (list, tuple)):  # scaled_mm_group: its users are getitems
        for user in list(node.users):
            assert user.target is operator.getitem, user
            out[user.args[1]].meta["stack_trace"] = user.meta.get("stack_trace")
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    else:
        out.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def replace_calls(graph: fx.Graph, impls: dict, skip=lambda node: False, keep_meta: tuple = ()) -> int:
    """Replace every call of an op in ``impls`` (op -> its implementation) by the trace of that
    implementation on the call's arguments, except where ``skip(node)``; returns how many.
    Calls of one signature (``_signature``: a model's layers) share one trace: a trace costs
    about 10 ms (a 32-layer torchao int8 Llama's decode graph on a CPU: 129 traces, 1.25 s of
    the pass's 1.96 s)."""
    count, traces = 0, {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in impls or skip(node):
            continue
        args = schema_args(node)
        key = _signature(node, args)
        if key in traces:
            _splice(graph, node, traces[key], _tensors(args), reused=True, keep_meta=keep_meta)
            count += 1
            continue
        traced = _trace(node, args, impls[node.target])
        if traced is None:  # left as an op call: slower to launch, as correct
            log.debug("%s: a size symbol has no source in the graph; not replaced", node)
            continue
        if key is not None and not traced[0].graph.find_nodes(op="get_attr"):
            traces[key] = traced[0]
        _splice(graph, node, *traced, keep_meta=keep_meta)
        count += 1
    return count


def _interpreted(node: fx.Node) -> bool:
    """A CUDA call where Triton's interpreter runs the kernels, which cannot be traced: it stays a call."""
    val = node.meta["val"]
    return (val[0] if isinstance(val, (list, tuple)) else val).device.type == "cuda" and INTERPRETED


def lower(graph: fx.Graph) -> int:
    """Replace every fusepass op call of ``graph`` by its implementation; returns how many."""
    count = replace_calls(graph, IMPLS, skip=_interpreted)
    if count:  # (Inductor analyses each lowered launch: once per signature, not per site)
        memoize_kernel_analysis(KERNELS)
    return count
