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
from: each level's non-tensor instance attributes (``vars()``), compared by value
(``EQUALS_MATCH``: numbers, strings, dtypes, and tuples and lists of those, exact types only), by
identity (``ID_MATCH``: functions, enum members), by type and then field by field (dataclasses
that compare with the ``__eq__`` ``dataclasses`` wrote, such as torchao's layouts and
activation-quantization settings), or by keys and then value by value (dicts). That checks what
the Python guards check where the flatten context holds only those attributes (the same
objects) and the level's own dtype, shape, device and layout (its ``TENSOR_MATCH``, which
stays); this is checked at compile time, and torchao's pass. Equal values, not the same objects,
so the layers of a model compiled one at a time still share one compiled graph. A weight with
anything else (a context entry computed or read from the class, ``__slots__``, an attribute of
another kind or with a name guard code cannot spell) keeps Dynamo's guards.
"""

from __future__ import annotations

import dataclasses
import enum
import keyword
import logging
import types

import torch

log = logging.getLogger(__name__)

# compared by value in C++, exact types only (Dynamo's EQUALS_MATCH copies exact lists; a list
# subclass changed in place would pass its same-object shortcut)
_VALUES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.layout,
           torch.memory_format)
_SEQUENCES = (tuple, list, torch.Size)
# compared by identity: singletons (IntEnum members included), and functions (equal only to
# themselves)
_IDENTITIES = (enum.Enum, types.FunctionType, types.BuiltinFunctionType)
# a level's own tensor metadata, which its TENSOR_MATCH guards and a flatten context may hold
_OWN = ("dtype", "shape", "device", "layout")


def _generated_eq(cls) -> bool:
    """Whether ``cls`` compares by the ``__eq__`` that ``dataclasses`` wrote (field by field),
    not one of its own."""
    code = getattr(cls.__eq__, "__code__", None)
    return cls.__dataclass_params__.eq and code is not None and code.co_filename == "<string>"


def _value_guards(value, source, builder) -> list | None:
    """Guards that hold exactly while the value at ``source`` stays equal to ``value``, or None
    where ``value`` is of a kind they cannot cover."""
    from torch._dynamo.source import AttrSource, DictGetItemSource

    if isinstance(value, _IDENTITIES):
        return [source.make_guard(builder.ID_MATCH)]
    if type(value) in _VALUES or (type(value) in _SEQUENCES and all(type(v) in _VALUES for v in value)):
        return [source.make_guard(builder.EQUALS_MATCH)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _generated_eq(type(value)):
        fields = [_value_guards(getattr(value, f.name), AttrSource(source, f.name), builder) if _name(f.name) else None
                  for f in dataclasses.fields(value) if f.compare]
        return None if None in fields else [source.make_guard(builder.TYPE_MATCH), *sum(fields, [])]
    if type(value) is dict and all(type(k) is str for k in value):  # (values by key: any str)
        items = [_value_guards(v, DictGetItemSource(source, k), builder) for k, v in value.items()]
        if None in items:
            return None
        return [source.make_guard(builder.TYPE_MATCH), source.make_guard(builder.DICT_KEYS_MATCH), *sum(items, [])]
    return None


def _name(name: str) -> bool:
    """An attribute name Dynamo can write into guard code."""
    return name.isidentifier() and not keyword.iskeyword(name)


def _level_guards(level: torch.Tensor, source, builder) -> list | None:
    """C++ guards on one level's attributes, or None where they would not cover its flatten
    context: a context entry that is neither one of its instance attributes (the same object)
    nor its own dtype, shape, device or layout (a class attribute, a computed value), slots, or
    an attribute of another kind."""
    from torch._dynamo.source import AttrSource

    if any("__slots__" in vars(c) for c in type(level).__mro__ if issubclass(c, torch.Tensor)
           and c not in (torch.Tensor, torch.nn.Parameter)):
        return None
    names, ctx = level.__tensor_flatten__()
    own = {name: v for name, v in vars(level).items() if name not in names and not name.startswith("_dynamo")}
    if ctx is None:
        entries = []
    elif type(ctx) is dict:
        entries = list(ctx.values())
    else:
        entries = list(ctx) if type(ctx) in (list, tuple) else [ctx]
    tensor = [getattr(level, a) for a in _OWN]
    if not all(any(e is v for v in own.values()) or any(type(t) is type(e) and t == e for t in tensor)
               for e in entries):
        return None
    guards = []
    for name, attr in own.items():  # (Dynamo's own marks, `_dynamo_*`, are set as it traces)
        g = _value_guards(attr, AttrSource(source, name), builder) if _name(name) else None
        if g is None:
            return None
        guards += g
    return guards


def cheaper_guards(levels: list[tuple[object, torch.Tensor]]) -> bool:
    """Swap, in the frame being compiled, Dynamo's metadata and inner-tensor-list guards on one
    weight's subclass ``levels`` (Dynamo's source and the value of the weight and of each inner
    subclass) for C++ guards on their attributes. False (nothing changed) where an attribute is
    of a kind those cannot cover, a level has no source, or outside a Dynamo compile."""
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import SubclassAttrListSource
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None or any(src is None for src, _ in levels):
        return False
    added = []
    for src, level in levels:
        try:
            guards = _level_guards(level, src, GuardBuilder)
        except Exception:  # (a field never set, an attribute that raises): Dynamo's guards stay
            guards = None
        if guards is None:
            log.debug("fusepass: a weight keeps Dynamo's metadata guards (%s)", type(level).__name__)
            return False
        added += guards
    metadata = {src for src, _ in levels}
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
