"""Static tensor-subclass inputs (torchao's quantized weights) taken apart at compile time."""

import gc
import weakref

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.two_tensor import TwoTensor

import fusepass.backend
from fusepass.static_subclasses import Flattened, _Rebuild, _spec, flatten_static_subclasses


def _nested(n=4):
    """TwoTensor(TwoTensor(a, b), c) of [4, n]: a subclass two deep, with three plain leaves."""
    g = torch.Generator().manual_seed(0)
    return TwoTensor(TwoTensor(torch.randn(4, n, generator=g), torch.randn(4, n, generator=g)),
                     torch.randn(4, n, generator=g))


class Model(torch.nn.Module):
    def __init__(self, requires_grad=False, n=4):
        super().__init__()
        self.w = torch.nn.Parameter(_nested(n), requires_grad=requires_grad)

    def forward(self, x):
        y = x @ self.w
        return y.a.a + y.a.b + y.b


class Spy:
    """A backend: the flattening, then AOTAutograd without Inductor; records what it saw."""

    def __init__(self):
        self.graphs, self.forward_inputs, self.calls = [], [], 0

    def __call__(self, gm, example_inputs):
        def forward(g, inputs):
            self.forward_inputs.append(inputs)
            return g

        compile_aot = aot_autograd(fw_compiler=forward)
        out = flatten_static_subclasses(gm, example_inputs)
        if out is None:
            self.graphs.append(None)
            return compile_aot(gm, example_inputs)
        gm, inputs, flattened = out
        self.graphs.append(gm)
        compiled = compile_aot(gm, inputs)

        def counted(*args):
            self.calls += 1
            return compiled(*args)

        return flattened.wrap(counted)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_nested_subclass_weight_becomes_its_plain_leaves():
    m, x, spy = Model(), torch.randn(3, 4), Spy()
    with torch.no_grad():
        out = torch.compile(m, backend=spy)(x)
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)
    (gm,) = spy.graphs
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # the weight's three leaves, static as the weight was, then the activation
    assert [p.meta["example_value"].shape for p in placeholders] == [(4, 4)] * 3 + [(3, 4)]
    assert [bool(p.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")) for p in placeholders] == \
        [True, True, True, False]
    # each leaf's Dynamo source is the weight's, then the attributes down to it
    assert [p._dynamo_source.name[-4:] for p in placeholders[:3]] == [".a.a", ".a.b", "'].b"]
    rebuilds = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, _Rebuild)]
    assert len(rebuilds) == 1 and list(rebuilds[0].args) == placeholders[:3]
    # AOTAutograd traced through the rebuild: its forward takes plain tensors only
    (inputs,) = spy.forward_inputs
    assert len(inputs) == 4 and all(type(t) is torch._subclasses.FakeTensor for t in inputs)


def test_leaves_are_reused_until_an_inner_tensor_is_replaced():
    seen = []
    w, plain = _nested(), torch.ones(2)
    flattened = Flattened({1: _spec(w)})
    run = flattened.wrap(lambda *args: seen.append(args))
    run(plain, w, plain)
    run(plain, w, plain)
    assert seen[0][0] is plain and seen[0][4] is plain
    assert [t is u for t, u in zip(seen[0][1:4], (w.a.a, w.a.b, w.b), strict=True)] == [True] * 3
    assert all(t is u for t, u in zip(seen[0], seen[1], strict=True))
    w.a.b = torch.zeros(4, 4)  # an inner tensor replaced: the next call passes the new one
    run(plain, w, plain)
    assert seen[2][2] is w.a.b and seen[2][1] is w.a.a
    w.a = TwoTensor(torch.ones(4, 4), torch.ones(4, 4))  # an inner subclass replaced
    run(plain, w, plain)
    assert seen[3][1] is w.a.a and seen[3][2] is w.a.b
    other = _nested()  # another model's weight, through the same graph
    run(plain, other, plain)
    assert [t is u for t, u in zip(seen[4][1:4], (other.a.a, other.a.b, other.b), strict=True)] == [True] * 3


def test_a_replaced_inner_tensor_reaches_the_compiled_model():
    m, x, spy = Model(), torch.randn(3, 4), Spy()
    fn = torch.compile(m, backend=spy)
    with torch.no_grad():
        fn(x)
        m.w.a.b = torch.randn(4, 4)
        out = fn(x)
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)
        m2 = Model()  # same class: Dynamo may run the same compiled graph on its weight
        m2.w.b.mul_(-1)
        torch.testing.assert_close(torch.compile(m2, backend=spy)(x), m2(x), rtol=0, atol=0)
    assert spy.calls >= 2


def test_inputs_that_are_not_static_subclasses_are_left_to_aot():
    spy = Spy()
    with torch.no_grad():
        x = _nested()  # a subclass activation: not static, AOTAutograd's own handling
        torch.compile(lambda t: t * 2, backend=spy)(x)
        plain = torch.nn.Linear(4, 4)  # plain weights: nothing to do
        torch.compile(plain, backend=spy)(torch.randn(2, 4))
    assert spy.graphs == [None, None]


def test_a_deleted_model_s_weights_are_freed():
    m, x = Model(), torch.randn(3, 4)
    fn = torch.compile(m, backend=Spy())
    with torch.no_grad():
        fn(x)
    weight, leaf = weakref.ref(m.w), weakref.ref(m.w.a.a)
    del m, fn
    gc.collect()
    # the compiled code (on forward's code object, until torch._dynamo.reset()) keeps no weight
    assert weight() is None and leaf() is None


class Aliased(torch.nn.Module):
    """Two weights sharing one inner tensor's memory, and a graph that reads an inner tensor."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shared = torch.randn(4, 4, generator=g)
        self.w1 = torch.nn.Parameter(TwoTensor(shared, torch.randn(4, 4, generator=g)), requires_grad=False)
        self.w2 = torch.nn.Parameter(TwoTensor(shared[:], torch.randn(4, 4, generator=g)), requires_grad=False)
        self.w3 = torch.nn.Parameter(TwoTensor(torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)),
                                     requires_grad=False)

    def forward(self, x):
        y = x @ self.w1 + x @ self.w2 + x @ self.w3
        return y.a + y.b + x @ self.w3.b


def test_aliased_weights_and_inner_tensors_read_by_the_graph_are_left_to_aot():
    m, x, spy = Aliased(), torch.randn(3, 4), Spy()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend=spy)(x), m(x), rtol=1e-6, atol=1e-6)
    assert spy.graphs == [None]


def test_a_weight_of_symbolic_size_is_left_to_aot():
    """Weights of a new width recompile with a symbolic width (automatic dynamic shapes, with
    parameters' shapes not forced static): the rebuild would bake the example's width in, so
    that graph keeps the subclass for AOTAutograd."""
    x, spy = torch.randn(3, 4), Spy()
    with torch._dynamo.config.patch(force_parameter_static_shapes=False), torch.no_grad():
        for n in (4, 6, 8):
            m = Model(n=n)
            torch.testing.assert_close(torch.compile(m, backend=spy)(x), m(x), rtol=0, atol=0)
    assert spy.graphs[0] is not None and len(spy.graphs) > 1 and spy.graphs[1:] == [None] * (len(spy.graphs) - 1)


def test_a_weight_being_trained_keeps_its_gradient():
    m, x, spy = Model(requires_grad=True), torch.randn(3, 4), Spy()

    def loss(x):
        return (x @ m.w).sum()

    torch.compile(loss, backend=spy)(x).backward()
    assert spy.graphs == [None]  # left to AOTAutograd, which routes the gradient to the subclass
    compiled_grad, m.w.grad = m.w.grad, None
    loss(x).backward()
    assert compiled_grad is not None
    torch.testing.assert_close(compiled_grad, m.w.grad, rtol=0, atol=0)


def test_the_fusepass_backend_compiles_torchao_weights_as_plain_tensors(monkeypatch):
    """Inductor gets plain tensors only, and the result is the one without the flattening,
    bit for bit (AOTAutograd traces the same graph either way)."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 48)).eval()
    quantize_(m, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    seen = []
    from torch._inductor.compile_fx import compile_fx

    def spy(gm, example_inputs, **kw):
        seen.append(all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in example_inputs))
        return compile_fx(gm, example_inputs, **kw)

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", spy)
    with torch.no_grad():
        flat = torch.compile(m, backend="fusepass")(x)
        with_flattening, seen[:] = seen[:], []
        torch._dynamo.reset()
        monkeypatch.setattr(fusepass.backend, "flatten_static_subclasses", lambda gm, ex: None)
        whole = torch.compile(m, backend="fusepass")(x)
    # plain inputs with the flattening, torchao's subclasses without
    assert with_flattening and all(with_flattening) and seen and not any(seen)
    assert torch.equal(flat, whole)
