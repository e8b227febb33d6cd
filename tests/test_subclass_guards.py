"""C++ guards on a taken-apart weight's attributes in place of Dynamo's Python metadata guards:
the same recompiles as Dynamo's guards would make, without ``__tensor_flatten__`` per call."""

import dataclasses
import enum
from collections import Counter

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from fusepass.static_subclasses import flatten_static_subclasses
from fusepass.subclass_guards import _value_guards


class Kind(enum.Enum):
    ROW = 1
    COL = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    tile: tuple = (1, 4)
    kind: Kind = Kind.ROW


def scale_of(t):
    return t


class Tagged(TwoTensor):
    """A TwoTensor with torchao-style metadata attributes, which its flatten context holds."""

    def __new__(cls, a, b, meta, outer_size=None, outer_stride=None):
        return super().__new__(cls, a, b, outer_size, outer_stride)

    def __init__(self, a, b, meta, outer_size=None, outer_stride=None):
        super().__init__(a, b, outer_size, outer_stride)
        self.keys = tuple(meta)
        for k, v in meta.items():
            setattr(self, k, v)

    def __tensor_flatten__(self):
        return ["a", "b"], {k: getattr(self, k) for k in self.keys}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Tagged(inner["a"], inner["b"], meta, outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs):
        if func is torch.ops.aten.detach.default:  # (nn.Parameter detaches it: a Tagged again)
            (w,) = args
            return Tagged(w.a.detach(), w.b.detach(), w.__tensor_flatten__()[1])
        # other results are plain TwoTensors
        return TwoTensor.__torch_dispatch__.__func__(TwoTensor, func, types, args, kwargs)


def _meta():
    return {"block": (1, 4), "qdtype": torch.int8, "kind": Kind.ROW, "quant": scale_of, "tiling": Layout(),
            "kwargs": {"eps": 1e-6}, "ranges": [-127, 127]}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = Tagged(torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g), _meta())
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        y = x @ self.w
        return y.a + y.b


class Backend:
    """Counts compiles, and the guard types and names each compiled frame kept (a ``guard_filter_fn``)."""

    def __init__(self):
        self.compiles, self.types, self.names = 0, Counter(), []

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        out = flatten_static_subclasses(gm, example_inputs)
        if out is None:
            return gm.forward
        gm, _, flattened = out
        return flattened.wrap(gm.forward)

    def filter(self, entries):
        self.types = Counter(e.guard_type for e in entries)
        self.names = [e.name for e in entries]
        return [True] * len(entries)

    def compile(self, fn):
        return torch.compile(fn, backend=self, options={"guard_filter_fn": self.filter})


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_dynamo_s_python_metadata_guards_are_replaced():
    m, x, backend = Model(), torch.randn(3, 4), Backend()
    with torch.no_grad():
        torch.testing.assert_close(backend.compile(m)(x), m(x), rtol=0, atol=0)
    assert backend.types["TENSOR_SUBCLASS_METADATA_MATCH"] == 0
    assert not [n for n in backend.names if "__tensor_flatten__" in n]  # nor the inner-tensor list
    # in their place: the dict's keys, the enum member and the function by identity
    assert backend.types["DICT_KEYS_MATCH"] >= 1 and backend.types["ID_MATCH"] >= 3


def _recompiles(change) -> int:
    m, x, backend = Model(), torch.randn(3, 4), Backend()
    fn = backend.compile(m)
    with torch.no_grad():
        fn(x)
        change(m.w)
        torch.testing.assert_close(fn(x), m(x), rtol=0, atol=0)
    return backend.compiles - 1


@pytest.mark.parametrize("change", [
    lambda w: setattr(w, "block", (2, 2)),
    lambda w: setattr(w, "qdtype", torch.uint8),
    lambda w: setattr(w, "kind", Kind.COL),
    lambda w: setattr(w, "quant", lambda t: t),
    lambda w: setattr(w, "tiling", Layout(tile=(4, 1))),
    lambda w: setattr(w, "tiling", Layout(kind=Kind.COL)),
    lambda w: w.kwargs.__setitem__("eps", 1e-5),
    lambda w: w.kwargs.__setitem__("other", 1),
    lambda w: w.ranges.__setitem__(0, -128),
    lambda w: w.ranges.append(0),
], ids=["tuple", "dtype", "enum", "function", "dataclass-field", "dataclass-enum", "dict-value", "dict-key",
        "list-item", "list-length"])
def test_a_changed_attribute_recompiles(change):
    assert _recompiles(change) == 1


def test_an_unchanged_or_equal_attribute_does_not_recompile():
    def equal_copies(w):
        w.block, w.tiling, w.kwargs, w.ranges = (1, 4), Layout(), {"eps": 1e-6}, [-127, 127]
        w.b.mul_(2)  # new data through the same graph

    assert _recompiles(lambda w: None) == 0
    assert _recompiles(equal_copies) == 0


def test_two_models_with_equal_metadata_share_one_graph():
    """Equal values, not the same objects: layers compiled one at a time share a graph."""
    x, backend = torch.randn(3, 4), Backend()
    m1, m2 = Model(), Model()
    m2.w.a.mul_(-1)
    assert m1.w.tiling is not m2.w.tiling and m1.w.kwargs is not m2.w.kwargs and m1.w.ranges is not m2.w.ranges
    with torch.no_grad():
        backend.compile(m1)(x)
        torch.testing.assert_close(backend.compile(m2)(x), m2(x), rtol=0, atol=0)
    assert backend.compiles == 1


class Opaque:
    """An attribute of a kind the C++ guards cannot cover (compared by its own __eq__)."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.v == self.v


def _add(name, value, in_context=True):
    def add(w):
        setattr(w, name, value)
        if in_context:
            w.keys += (name,)
    return add


@dataclasses.dataclass(eq=False)
class ByIdentity:
    tile: tuple = (1, 4)


class Ranges(list):
    """A list subclass: Dynamo's value guard would not copy it, and misses in-place changes."""


@dataclasses.dataclass
class OwnEq:
    tile: tuple = (1, 4)

    def __eq__(self, other):  # (compares more than the fields)
        return type(other) is OwnEq and other.tile == self.tile and getattr(other, "extra", 0) == getattr(self, "extra", 0)


class Classy(Tagged):
    factor = 2  # a class attribute in the flatten context


class Slotted(Tagged):
    __slots__ = ()


def _retype(cls):
    def retype(w):
        w.__class__ = cls
        if cls is Classy:
            w.keys += ("factor",)
    return retype


@pytest.mark.parametrize("add", [_add("opaque", Opaque(1)), _add("nested", [(1, 2)]),
                                 _add("spare", torch.ones(2), in_context=False), _add("ranges2", Ranges([1, 2])),
                                 _add("tile", OwnEq()), _add("class", 1), _retype(Classy), _retype(Slotted)],
                         ids=["object", "list-of-tuples", "unlisted-tensor", "list-subclass", "dataclass-own-eq",
                              "keyword-name", "class-attribute", "slots"])
def test_a_weight_with_another_kind_of_attribute_keeps_dynamo_s_guards(add):
    m, x, backend = Model(), torch.randn(3, 4), Backend()
    add(m.w)
    with torch.no_grad():
        fn = backend.compile(m)
        fn(x)
    assert backend.types["TENSOR_SUBCLASS_METADATA_MATCH"] == 1
    if hasattr(m.w, "opaque"):  # and Dynamo's guard still sees a change
        m.w.opaque.v = 2
        with torch.no_grad():
            fn(x)
        assert backend.compiles == 2


def test_a_dataclass_compared_by_identity_is_not_compared_field_by_field():
    """(Dynamo's own guard fails on such a context at once: it compares a deep copy.)"""
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import LocalSource

    assert _value_guards(ByIdentity(), LocalSource("w"), GuardBuilder) is None
    assert len(_value_guards(Layout(), LocalSource("w"), GuardBuilder)) == 3  # its type, then 2 fields


def test_torchao_weights_lose_their_python_guards():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 48)).eval()
    quantize_(m, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    x, backend = torch.randn(2, 8, 64), Backend()
    with torch.no_grad():
        fn = backend.compile(m)
        torch.testing.assert_close(fn(x), m(x))
        assert backend.types["TENSOR_SUBCLASS_METADATA_MATCH"] == 0
        fn(x)
    assert backend.compiles == 1
