"""Lowering (fusepass/passes/lower.py): the op calls become their implementation's ops, and
calls of one signature (a model's layers) share one trace, each with fake values of its own."""

import torch
from torch._dynamo.utils import counters

from fusepass.backend import capture_backend
from fusepass.passes import FusePass, PassConfig
from fusepass.passes import lower as lower_mod
from tests.passes.data import K, M, N, i8, scale

LAYERS = 3
w = [i8(N, K, seed=i) for i in range(LAYERS)] + [i8(N + 8, K, seed=9)]
sw = [scale(1, N, seed=i) for i in range(LAYERS)] + [scale(1, N + 8, seed=9)]


def layers(a, sa, n=LAYERS):
    """``n`` int8 matmuls of one signature, and one of another N."""
    outs = [(torch._int_mm(a, w[i].t()).float() * sa * sw[i]).to(torch.bfloat16) for i in range(n)]
    outs.append((torch._int_mm(a, w[-1].t()).float() * sa * sw[-1]).to(torch.bfloat16))
    return outs


def run(fn, *args, dynamic=None):
    """Compiled with the pass and its lowering; the lowered graph, the traces taken, the outputs."""
    traced, graphs = [], []
    trace = lower_mod._trace

    def counted(node, *args):
        traced.append(node)
        return trace(node, *args)

    def on_graph(gm):
        lower_mod._trace = counted
        try:
            FusePass(PassConfig(group_max_m=0))(gm.graph)  # (the layers' calls share their activation)
        finally:
            lower_mod._trace = trace
        graphs.append(gm.graph)

    torch._dynamo.reset()
    counters["fusepass"].clear()
    with torch.no_grad():
        out = torch.compile(fn, backend=capture_backend(on_graph), dynamic=dynamic, fullgraph=True)(*args)
    return graphs[0], traced, out


def test_one_trace_per_signature():
    a, sa = i8(M, K, seed=5), scale(M, 1, seed=6)
    graph, traced, out = run(layers, a, sa)
    assert len(traced) == 2  # N and N + 8; the 3 layers of N share one
    assert not [n for n in graph.nodes if "fusepass" in str(n.target)]
    mms = [n for n in graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == LAYERS + 1  # every call lowered (on CPU to the reference's int32 mm)
    for got, want in zip(out, layers(a, sa), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_each_site_has_fake_values_of_its_own():
    """A later pass (Inductor's reinplacing, say) tells buffers apart by their fake storages."""
    graph, _, _ = run(layers, i8(M, K, seed=5), scale(M, 1, seed=6))
    vals = [n.meta["val"] for n in graph.nodes if n.target is torch.ops.aten.mm.default]
    storages = {id(v.untyped_storage()) for v in vals}
    assert len(storages) == len(vals) and all(v.shape[0] == M for v in vals)


def test_symbolic_sizes_are_traced_per_call():
    a, sa = i8(M, K, seed=5), scale(M, 1, seed=6)
    torch._dynamo.mark_dynamic(a, 0)
    torch._dynamo.mark_dynamic(sa, 0)
    _, traced, out = run(layers, a, sa)
    assert len(traced) == LAYERS + 1
    for got, want in zip(out, layers(a, sa), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_signature_tells_layouts_apart():
    """A transposed or offset operand is another trace (the kernels' layout and alignment
    checks read strides and storage offsets)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        base = torch.empty(8, 16, dtype=torch.int8)
        views = [base, base.t().contiguous().t(), base[1:]]
    keys = []
    for v in views:
        x.meta["val"] = v
        node = graph.call_function(torch.ops.fusepass.int_mm.default, (x, x))
        keys.append(lower_mod._signature(node, [x, x]))
    assert len(set(keys)) == 3


CUDA_SCRIPT = r'''
import torch, fusepass
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from fusepass.kernels.launch import INTERPRETED
from fusepass.passes import lower as L

assert not INTERPRETED
with FakeTensorMode(allow_non_fake_inputs=True):
    a = torch.empty(1, 4096, dtype=torch.int8, device="cuda")
    sa, sb = torch.empty(1, 1, device="cuda"), torch.empty(6144, device="cuda")
    ws = [torch.empty(6144, 4096, dtype=torch.int8, device="cuda") for _ in range(3)]

def f(a, sa, sb, *ws):
    return [torch.ops.fusepass.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, None) for w in ws]

gm = make_fx(f, tracing_mode="fake")(a, sa, sb, *ws)
traced, trace = [], L._trace
L._trace = lambda node, *args: traced.append(node) or trace(node, *args)
assert L.lower(gm.graph) == 3
hops = [n for n in gm.graph.nodes if "triton_kernel_wrapper_mutation" in str(n.target)]
outs = [h.kwargs["kwargs"]["out_ptr"] for h in hops]
weights = [h.kwargs["kwargs"]["b_ptr"].args[0].name for h in hops]
print(len(traced), len(hops), len({id(o.meta["val"].untyped_storage()) for o in outs}), weights)
'''


def test_cuda_launches_share_a_trace_with_buffers_of_their_own():
    """The CUDA form (a Triton launch writing a new buffer), traced on fake CUDA tensors
    without the interpreter, as Inductor's post-grad pass sees it on a GPU machine."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CUDA_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "1 3 3 ['arg3_1', 'arg4_1', 'arg5_1']", done.stdout  # (each its own weight)


def test_a_value_passed_twice_is_another_signature():
    """``make_fx`` reads a value given twice from one placeholder: the trace of
    ``scaled_mm(a, b, s, s)`` must not serve a later ``scaled_mm(a, b, s, t)``."""
    a, w0, w1 = i8(M, K, seed=5), i8(N, K, seed=1), i8(N, K, seed=4)
    s, t = scale(seed=2).reshape(()), scale(seed=3).reshape(()) * 1.5  # 0-d: the op takes them as they are

    def f(a, w0, w1, s, t):
        first = torch._int_mm(a, w0.t()).float() * s * s
        second = torch._int_mm(a, w1.t()).float() * s * t
        return first, second

    _, traced, out = run(f, a, w0, w1, s, t)
    assert len(traced) == 2
    for got, want in zip(out, f(a, w0, w1, s, t), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
