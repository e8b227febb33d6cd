"""Weights that are tensor subclasses (torchao's quantized tensors) taken apart once, at compile
time, instead of on every call.

AOTAutograd compiles a graph whose inputs are traceable tensor subclasses by flattening each
such input into its inner tensors on every call (``runtime_unwrap_tensor_subclasses``). A
torchao model's weights are such inputs, nested two or three deep: on torch 2.11 that Python
work was ~1 ms of a 1.8 ms CUDA-graph decode step of 4 Llama-3-8B layers quantized with
torchao int8, where the same model quantized by hand (plain tensors) took 0.80 ms and bf16
1.01 ms (H200, benchmarks/NOTES.md run 13).

``flatten_static_subclasses`` rewrites the Dynamo graph before Inductor sees it: a placeholder
that Dynamo marked a static input (a parameter or a static buffer) holding a traceable
subclass becomes one placeholder per plain inner tensor, and a node that rebuilds the subclass
from them (``__tensor_unflatten__``, which AOTAutograd traces through as it would its own
unflatten). The compiled function then takes plain tensors only. ``Flattened.wrap`` gives it
the leaves of each such argument from a per-argument cache: the same subclass object whose
attribute path to each leaf still reaches the same tensor object (two ``attrgetter`` calls);
anything else (another model's weight reusing the graph, a reassigned inner tensor) is
flattened afresh. In-place changes to a weight's data need nothing: the leaves are those
tensors. The cache holds a weight only weakly. Inputs that are not static (activations), not
subclasses, need a gradient, have a symbolic size, or share a leaf with another input (or
the graph reads one of their inner tensors itself) keep AOTAutograd's own handling. For each
weight taken apart, Dynamo's Python guards on its metadata become C++ guards on its attributes
(``subclass_guards.py``).

AOTAutograd's cache passes over a graph with the rebuild node (its target is none of the torch
functions that cache knows to be safe, so no entry can be served for another subclass layout);
Inductor's FX graph cache, keyed on the graph AOTAutograd traced, still hits.
"""

from __future__ import annotations

import functools
import logging
import operator
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .subclass_guards import cheaper_guards

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Spec:
    """How to rebuild one subclass value from its leaves: its type, flatten context and outer
    size and stride, and each inner attribute's spec (None for a plain tensor leaf)."""

    cls: type
    ctx: object
    size: tuple[int, ...]
    stride: tuple[int, ...]
    inner: tuple[tuple[str, _Spec | None], ...]

    def paths(self, prefix: tuple[str, ...] = (), leaves_only: bool = True) -> list[tuple[str, ...]]:
        """The attribute path from the outer value to each leaf, in leaf order (or to every
        inner value, leaves and the subclasses between, where not ``leaves_only``)."""
        out = []
        for name, spec in self.inner:
            path = prefix + (name,)
            if spec is None or not leaves_only:
                out.append(path)
            if spec is not None:
                out += spec.paths(path, leaves_only)
        return out

    def rebuild(self, leaves) -> torch.Tensor:
        """The subclass value, taking its leaves from the iterator ``leaves``."""
        inner = {name: next(leaves) if spec is None else spec.rebuild(leaves) for name, spec in self.inner}
        return self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)


def _symbolic(fake) -> bool:
    """Whether Dynamo's fake value of an input (or of an inner tensor) has a symbolic size or
    stride (the real example's are always ints)."""
    if not isinstance(fake, torch.Tensor):
        return False
    if not all(isinstance(s, int) for s in (*fake.size(), *fake.stride())):
        return True
    return is_traceable_wrapper_subclass(fake) and any(_symbolic(getattr(fake, a)) for a in fake.__tensor_flatten__()[0])


def _spec(t: torch.Tensor) -> _Spec | None:
    """``t``'s spec, or None where it cannot be taken apart statically (an inner value that
    is not a tensor, an attribute name that is no identifier)."""
    attrs, ctx = t.__tensor_flatten__()
    size, stride = tuple(t.size()), tuple(t.stride())
    inner = []
    for name in attrs:
        value = getattr(t, name)
        # (identifiers: placeholder names, and attrgetter's dotted paths)
        if not isinstance(value, torch.Tensor) or not name.isidentifier():
            return None
        if is_traceable_wrapper_subclass(value):
            sub = _spec(value)
            if sub is None:
                return None
            inner.append((name, sub))
        else:
            inner.append((name, None))
    return _Spec(type(t), ctx, size, stride, tuple(inner))


def _walk(t, path: tuple[str, ...]):
    for name in path:
        t = getattr(t, name)
    return t


class _Rebuild:
    """The graph node's target: the subclass value of one input, from its leaves."""

    def __init__(self, spec: _Spec, name: str):
        self.spec = spec
        self.__name__ = f"rebuild_{name}"  # (FX names the generated code's global after it)

    def __call__(self, *leaves):
        return self.spec.rebuild(iter(leaves))


@dataclass
class Flattened:
    """The rewritten graph's inputs: the spec of each original argument taken apart (by
    position; the others are passed as they are)."""

    specs: dict[int, _Spec]

    def wrap(self, compiled):
        """``compiled`` (of the rewritten graph) called with the original arguments."""
        order = sorted(self.specs, reverse=True)  # (splice from the back: earlier positions hold)
        # per argument, one C call each: every inner value (to check), the leaves (to pass)
        inner = {i: operator.attrgetter(*[".".join(p) for p in s.paths(leaves_only=False)], "__class__")
                 for i, s in self.specs.items()}
        leaves = {i: operator.attrgetter(*[".".join(p) for p in s.paths()], "__class__")
                  for i, s in self.specs.items()}
        # per argument: (weak reference to the value, its inner objects, its leaves). Weak: the
        # compiled code outlives a deleted model, whose weights must not (an entry goes with
        # its value).
        cache: dict[int, tuple[weakref.ref, tuple, list]] = {}

        def forget(ref, i):
            if i in cache and cache[i][0] is ref:
                del cache[i]

        def run(*args):
            flat = list(args)
            for i in order:
                value, hit = flat[i], cache.get(i)
                # the same object with the same inner objects all the way down: the same leaves
                if hit is None or hit[0]() is not value or not all(map(operator.is_, inner[i](value), hit[1])):
                    ref = weakref.ref(value, functools.partial(forget, i=i))
                    hit = cache[i] = (ref, inner[i](value), list(leaves[i](value)[:-1]))
                flat[i:i + 1] = hit[2]
            return compiled(*flat)

        return run


def _attr_source(source, path: tuple[str, ...]):
    """Dynamo's source of the leaf at ``path`` under ``source`` (AOTAutograd keys its
    duplicate-input guards and static-input bookkeeping on placeholders' sources)."""
    from torch._dynamo.source import AttrSource

    for name in path:
        source = None if source is None else AttrSource(source, name)
    return source


def _takes_apart(node: torch.fx.Node, x) -> bool:
    """A static input (a parameter or static buffer) holding a traceable subclass, with no
    gradient to carry (a weight being trained, as torchao's float8 training weights are, keeps
    AOTAutograd's handling, which routes its gradient back to the subclass) and static sizes
    (the rebuild takes the example's: a dynamic size would be specialized)."""
    return (isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x) and not x.requires_grad
            and bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
            and not _symbolic(node.meta.get("example_value")))


def _storage(t) -> int:
    return t.untyped_storage()._cdata


def _unshared(specs: list, placeholders: list, example_inputs: list) -> list:
    """``specs`` less those that cannot stand alone: a leaf whose memory another input or
    another subclass's leaf shares, or whose source is another placeholder's (the graph reads
    ``weight.qdata`` itself). AOTAutograd keeps such aliasing straight across its own
    flattening; taken apart before it, aliased leaves became wrong results after an in-place
    update (two weights sharing an inner tensor, the sharing later undone)."""
    # per input taken apart: (path, storage) of each leaf
    leaves = [None if s is None else [(path, _storage(_walk(x, path))) for path in s.paths()]
              for x, s in zip(example_inputs, specs, strict=True)]
    seen = Counter(_storage(x) for x, s in zip(example_inputs, specs, strict=True)
                   if s is None and isinstance(x, torch.Tensor) and not is_traceable_wrapper_subclass(x))
    for own in filter(None, leaves):
        seen.update({storage for _, storage in own})  # (a subclass may alias itself)
    sources = {getattr(p, "_dynamo_source", None) for p in placeholders} - {None}
    out = []
    for p, s, own in zip(placeholders, specs, leaves, strict=True):
        source = getattr(p, "_dynamo_source", None)
        if own and any(seen[storage] > 1 or _attr_source(source, path) in sources for path, storage in own):
            s = None
        out.append(s)
    return out


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph module to rewrite (Dynamo reads its own placeholders after the
    backend returns), with what AOTAutograd reads off it, as Dynamo's DDPOptimizer copies it."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, val_map := {})
    graph.output(out)
    for old, new in val_map.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta = gm.meta
    for name, value in gm.__dict__.items():  # _param_name_to_source and whatever a torch adds
        if name not in copy.__dict__:
            setattr(copy, name, value)
    return copy


def flatten_static_subclasses(gm: torch.fx.GraphModule, example_inputs: list):
    """A copy of ``gm`` in which each static traceable-subclass input is its leaves (module
    docstring), its example inputs and the ``Flattened`` to wrap its compiled function with;
    or None where ``gm`` has no such input."""
    if not any(isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x) for x in example_inputs):
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return None
    specs = [_spec(x) if _takes_apart(p, x) else None for p, x in zip(placeholders, example_inputs, strict=True)]
    specs = _unshared(specs, placeholders, example_inputs)
    if not any(specs):
        return None
    for p, x, spec in zip(placeholders, example_inputs, specs, strict=True):
        if spec is not None:  # the weight and each inner subclass: Dynamo's source, the value
            leaves, source = set(spec.paths()), getattr(p, "_dynamo_source", None)
            levels = [()] + [path for path in spec.paths(leaves_only=False) if path not in leaves]
            cheaper_guards([(_attr_source(source, path), _walk(x, path)) for path in levels])
    gm = _copy(gm)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    new_inputs: list = []
    rebuilds = []  # (old placeholder, spec, leaf placeholders)
    for p, x, spec in zip(placeholders, example_inputs, specs, strict=True):
        if spec is None:
            new_inputs.append(x)
            continue
        fake, source = p.meta.get("example_value"), getattr(p, "_dynamo_source", None)
        leaves = []
        with gm.graph.inserting_before(p):
            for path in spec.paths():
                leaf = gm.graph.placeholder(f"{p.name}_{'_'.join(path)}")
                leaf.meta.update({k: v for k, v in p.meta.items() if k in ("tensor_dict", "stack_trace")})
                if fake is not None:
                    leaf.meta["example_value"] = _walk(fake, path)
                leaf._dynamo_source = _attr_source(source, path)
                leaves.append(leaf)
                new_inputs.append(_walk(x, path))
        rebuilds.append((p, spec, leaves))
    # (after every placeholder: code downstream takes the placeholders to come first)
    with gm.graph.inserting_after(list(gm.graph.find_nodes(op="placeholder"))[-1]):
        rebuilt = [gm.graph.call_function(_Rebuild(spec, p.name), tuple(leaves))
                   for p, spec, leaves in reversed(rebuilds)][::-1]
    for (p, _, _), node in zip(rebuilds, rebuilt, strict=True):
        node.meta.update({k: v for k, v in p.meta.items() if k != "grapharg"})
        p.replace_all_uses_with(node)
        gm.graph.erase_node(p)
    gm.recompile()
    log.debug("fusepass: %d static subclass inputs taken apart into %d plain inputs",
              sum(s is not None for s in specs), len(new_inputs) - sum(s is None for s in specs))
    return gm, new_inputs, Flattened({i: s for i, s in enumerate(specs) if s is not None})
