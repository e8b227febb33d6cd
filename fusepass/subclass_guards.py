"""C++ guards in place of Dynamo's Python metadata guards, for the tensor-subclass weights that
``static_subclasses`` takes apart.

Dynamo guards each level of a traceable subclass input (torchao's quantized weights are two or
three levels deep) with two Python checks that call ``__tensor_flatten__`` on every call of the
compiled model: its metadata, and its list of inner tensors, equal to those traced. For the 29
weights of 4 Llama-3-8B layers under torchao 0.17 int8 that is 174 Python guards a step. With
the C++ guards below in their place, the time from a batch-1 decode step's call to the compiled
code's entry went from 353 to 233 us in CUDA graphs and from 584 to 335 us in default mode
(medians of 9 rounds over 3 compiles each, alternated in one process; fp8: 223 to 176 us;
H200, ``benchmarks/NOTES.md`` run 18).

``cheaper_guards`` replaces them, for one weight, with C++ guards on what they are computed
from: each level's non-tensor attributes (``vars()``), compared by value (``EQUALS_MATCH``:
numbers, strings, dtypes, tuples and lists of those), by identity (``ID_MATCH``: functions,
enum members), by type and then field by field (dataclasses that compare by their fields, such as torchao's layouts and
activation-quantization settings), or by keys and then value by value (dicts). That checks
what the Python guards check wherever ``__tensor_flatten__`` is a function of the class, the
tensor's own size, stride and dtype (its ``TENSOR_MATCH``, which stays) and its attributes;
torchao's are. Equal values, not the same objects, so the layers of a model compiled one at a
time still share one compiled graph. A weight with any other kind of attribute (a tensor
``__tensor_flatten__`` does not list, an arbitrary object) keeps Dynamo's guards.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import types

import torch

log = logging.getLogger(__name__)

# compared by value in C++ (Dynamo's EQUALS_MATCH takes these, lists copied)
_VALUES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.layout,
           torch.memory_format)
# compared by identity: singletons, and functions (whose equality is identity)
_IDENTITIES = (enum.Enum, types.FunctionType, types.BuiltinFunctionType)


def _value_guards(value, source, builder) -> list | None:
    """Guards that hold exactly while the value at ``source`` stays equal to ``value``, or None
    where ``value`` is of a kind they cannot cover."""
    from torch._dynamo.source import AttrSource, DictGetItemSource

    if isinstance(value, _VALUES) or (isinstance(value, (tuple, list)) and all(type(v) in _VALUES for v in value)):
        return [source.make_guard(builder.EQUALS_MATCH)]
    if isinstance(value, _IDENTITIES):
        return [source.make_guard(builder.ID_MATCH)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.eq:
        fields = [_value_guards(getattr(value, f.name), AttrSource(source, f.name), builder)
                  for f in dataclasses.fields(value)]
        return None if None in fields else [source.make_guard(builder.TYPE_MATCH), *sum(fields, [])]
    if type(value) is dict and all(type(k) is str for k in value):
        items = [_value_guards(v, DictGetItemSource(source, k), builder) for k, v in value.items()]
        if None in items:
            return None
        return [source.make_guard(builder.TYPE_MATCH), source.make_guard(builder.DICT_KEYS_MATCH), *sum(items, [])]
    return None


def cheaper_guards(source, value: torch.Tensor, levels: list[tuple[str, ...]]) -> bool:
    """Swap, in the frame being compiled, Dynamo's metadata and inner-tensor-list guards on the
    weight ``value`` at ``source`` and on its inner subclasses (at attribute ``levels``) for C++
    guards on their attributes. False (nothing changed) where an attribute is of a kind those
    cannot cover, or outside a Dynamo compile."""
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import AttrSource, SubclassAttrListSource
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None or source is None:
        return False
    sources = {(): source}
    for path in sorted(levels, key=len):
        sources[path] = AttrSource(sources[path[:-1]], path[-1])
    added = []
    for path, src in sources.items():
        level = value
        for name in path:
            level = getattr(level, name)
        inner = set(level.__tensor_flatten__()[0])
        for name, attr in vars(level).items():
            if name in inner or name.startswith("_dynamo"):  # (Dynamo's own marks, set as it traces)
                continue
            guards = _value_guards(attr, AttrSource(src, name), GuardBuilder)
            if guards is None:
                log.debug("fusepass: %s keeps Dynamo's metadata guards (%s is a %s)", source.name, name,
                          type(attr).__name__)
                return False
            added += guards
    metadata = set(sources.values())
    lists = {SubclassAttrListSource(s) for s in metadata}
    dynamo = context.guards_context.dynamo_guards
    drop = [g for g in dynamo.inner
            if (g.originating_source in metadata and g.create_fn_name() == "TENSOR_SUBCLASS_METADATA_MATCH")
            or (g.originating_source in lists and g.create_fn_name() == "EQUALS_MATCH")]
    for g in drop:
        dynamo.inner.remove(g)
        by_source = getattr(dynamo, "source_to_guards", {}).get(g.originating_source)
        if by_source and g in by_source:
            by_source.remove(g)
    for g in added:
        dynamo.add(g, collect_debug_stack=False)
    return True
