"""What must stay unchanged (docs/PATTERNS.md, "left alone"), each with the reason the pass gives. (A chain
that can be fused in part is: tests/passes/test_prefix.py.)"""

import re

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.passes import FusePass
from tests.passes.data import K, M, N, bias, i8, scale
from tests.passes.harness import run_pass

F = torch.nn.functional
a, b = i8(M, K), i8(N, K, seed=1).t()
sa, sb = scale(M, 1), scale(1, N, seed=2)


def acc_has_another_user(a, b, sa, sb):
    acc = torch._int_mm(a, b)
    return acc.float() * sa * sb, acc.sum()


FULL = scale(M, N, seed=5)  # one value per element: not a product of row and column scales


def full_mn_scale(a, b, sa, sb):
    return torch._int_mm(a, b).float() * FULL * sb


def per_batch_scale_on_3d(a, b, sa, sb):
    y = torch._int_mm(a, b).float().reshape(2, M // 2, N)
    return y * sa.reshape(2, M // 2, 1)[:, :1]  # [2, 1, 1]: neither per-token nor per-channel


def non_elementwise_op_in_chain(a, b, sa, sb):
    return torch._int_mm(a, b).float().cumsum(1) * sa * sb


K_SCALE = scale(1, K, seed=6)
BIAS = bias()


def activation_scale_along_k(a, b, sa, sb):
    return F.linear(a.float() * K_SCALE, b.t().float() * sb.t())


def unsupported_dtype_e5m2(a, b, sa, sb):
    x, w = a.to(torch.float8_e5m2), b.t().to(torch.float8_e5m2)
    return F.linear(x.float() * sa, w.float() * sb.t())


def uint8_without_correction(a, b, sa, sb):
    return torch._int_mm((a.to(torch.int32) + 128).to(torch.uint8), b).float() * sa * sb


def bias_before_scaling(a, b, sa, sb):
    return (torch._int_mm(a, b).float() + BIAS) * sa * sb


CASES = [
    (acc_has_another_user, "the accumulator is used by 2 ops"),
    (full_mn_scale, "is not per-tensor, per-token or per-channel"),
    (per_batch_scale_on_3d, "is not per-tensor, per-token or per-channel"),
    (non_elementwise_op_in_chain, "no scale multiply follows the int32 accumulator"),
    (activation_scale_along_k, "activation scale .* varies along K"),
    (unsupported_dtype_e5m2, "operands are torch.float8_e5m2 x torch.float8_e5m2"),
    (uint8_without_correction, "uint8 activations without the matching - 128"),
    (bias_before_scaling, "no scale multiply follows the int32 accumulator"),
]


@pytest.mark.parametrize("fn,reason", CASES, ids=[c[0].__name__ for c in CASES])
def test_left_unchanged(fn, reason):
    if fn is uint8_without_correction and torch.__version__ < "2.12":
        pytest.skip("torch._int_mm takes uint8 activations from torch 2.12 on")
    r = run_pass(fn, a, b, sa, sb)
    assert r.counts == {}
    assert r.after == r.before
    assert len(r.decisions) == 1 and not r.decisions[0].fused
    assert re.search(reason, r.decisions[0].reason), r.decisions[0].reason
    torch.testing.assert_close(r.out, fn(a, b, sa, sb))


def _fake_cuda_graph(f, *shapes_and_devices):
    with FakeTensorMode():
        args = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype, dev in shapes_and_devices]
        return make_fx(f, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def test_mixed_devices_are_never_fused():
    """A scale on another device than the matmul (no eager program can multiply those;
    the guard keeps the pass from ever producing one): the epilogue ends before it, the
    multiply stays as it was."""

    def f(a, b, sa, sb):
        return torch._int_mm(a, b).float() * sa * sb

    gm = _fake_cuda_graph(f, ((M, K), torch.int8, "cuda"), ((K, N), torch.int8, "cuda"),
                          ((M, 1), torch.float32, "cuda"), ((1, N), torch.float32, "cuda"))
    sb_node = [n for n in gm.graph.nodes if n.op == "placeholder"][3]
    with sb_node.meta["val"].fake_mode:
        sb_node.meta["val"] = torch.empty(1, N, device="meta")  # any other device; meta needs no GPU
    (d,) = FusePass().run(gm.graph)
    assert d.partial and "is on meta, the matmul on cuda:0 (mixed devices)" in d.reason
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusepass.scaled_mm.default]
    assert [u.args for u in op.users] == [(op, sb_node)]  # sb applied outside, as written

    # Mixed devices at the first step: nothing to fuse, the graph stays.
    gm = _fake_cuda_graph(f, ((M, K), torch.int8, "cuda"), ((K, N), torch.int8, "cuda"),
                          ((M, 1), torch.float32, "cuda"), ((1, N), torch.float32, "cuda"))
    sa_node = [n for n in gm.graph.nodes if n.op == "placeholder"][2]
    with sa_node.meta["val"].fake_mode:
        sa_node.meta["val"] = torch.empty(M, 1, device="meta")
    before = str(gm.graph)
    (d,) = FusePass().run(gm.graph)
    assert not d.fused and "(mixed devices)" in d.reason and str(gm.graph) == before


def test_cpu_scalar_scale_on_a_cuda_graph_is_a_number():
    """A 0-d CPU tensor broadcasts into CUDA ops as a number (torch 2.11 passes Python float
    scales that way under dynamic=True): fused, read on the host, no device sync."""

    def f(a, b, sa, s_cpu):
        return torch._int_mm(a, b).float() * sa * s_cpu

    gm = _fake_cuda_graph(f, ((M, K), torch.int8, "cuda"), ((K, N), torch.int8, "cuda"),
                          ((M, 1), torch.float32, "cuda"), ((), torch.float32, "cpu"))
    (d,) = FusePass().run(gm.graph)
    assert d.fused, d.reason
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusepass.scaled_mm.default]
    scale_b = op.args[3]  # the CPU scalar, multiplied into a CUDA constant
    assert scale_b.target is torch.ops.aten.mul.Tensor and scale_b.meta["val"].device.type == "cuda"
    assert scale_b.args[1].op == "placeholder" and scale_b.args[1].meta["val"].device.type == "cpu"


def test_cuda_graph_is_rewritten_without_a_gpu():
    def f(a, b, sa, sb, bias):
        return (torch._int_mm(a, b).float() * sa * sb + bias).to(torch.bfloat16)

    with FakeTensorMode():
        cuda = dict(device="cuda")
        args = (torch.empty(M, K, dtype=torch.int8, **cuda), torch.empty(K, N, dtype=torch.int8, **cuda),
                torch.empty(M, 1, **cuda), torch.empty(1, N, **cuda), torch.empty(N, **cuda))
        gm = make_fx(f, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
        (d,) = FusePass().run(gm.graph)
    assert d.fused and d.op == "fusepass.scaled_mm"
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusepass.scaled_mm.default]
    assert op.meta["val"].device.type == "cuda" and op.meta["val"].dtype == torch.bfloat16
