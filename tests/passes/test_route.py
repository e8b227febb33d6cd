"""An int8 matmul the pass leaves alone on CUDA, where torch._int_mm cannot run it (M <= 16,
a symbolic M, K or N not a multiple of 8), runs on fusepass.int_mm instead: a compiled
model never stops on it. Fake CUDA graphs: no GPU needed."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import fusepass
from fusepass.passes import FusePass


def shared_accumulator(a, b, s):
    acc = torch._int_mm(a, b)  # also returned raw: nothing of the epilogue can fuse
    return acc.float() * s, acc


def _graph(M, K, N, symbolic=False):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if symbolic else DimDynamic.STATIC,
                                                      DimDynamic.STATIC])
    rows = mode.from_tensor(torch.empty(M, K, dtype=torch.int8), symbolic_context=dynamic).shape[0]
    with mode:
        args = (torch.empty(rows, K, dtype=torch.int8, device="cuda"), torch.empty(K, N, dtype=torch.int8, device="cuda"),
                torch.empty(rows, 1, device="cuda"))
    return make_fx(shared_accumulator, select_decomp_table(), tracing_mode="real")(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("M,K,N", [(1, 64, 40), (16, 64, 40), (32, 60, 40), (32, 64, 36)],
                         ids=["M=1", "M=16", "K%8", "N%8"])
def test_unfused_int_mm_that_cublas_cannot_run_is_routed(M, K, N):
    gm = _graph(M, K, N)
    (d,) = FusePass().run(gm.graph)
    assert not d.fused and d.rerouted == "fusepass.int_mm"
    assert torch.ops.aten._int_mm.default not in _targets(gm)
    assert torch.ops.fusepass.int_mm.default in _targets(gm)
    assert "runs on fusepass.int_mm" in str(fusepass.Report([d]))


def test_symbolic_m_is_routed():
    gm = _graph(32, 64, 40, symbolic=True)
    (d,) = FusePass().run(gm.graph)
    assert d.rerouted == "fusepass.int_mm"


def test_what_cublas_runs_stays_on_cublas():
    gm = _graph(32, 64, 40)
    (d,) = FusePass().run(gm.graph)
    assert not d.fused and d.rerouted is None
    assert torch.ops.aten._int_mm.default in _targets(gm)


def test_cpu_graphs_are_not_routed():
    def f(a, b, s):
        return shared_accumulator(a, b, s)

    with FakeTensorMode():
        args = (torch.empty(1, 64, dtype=torch.int8), torch.empty(64, 40, dtype=torch.int8), torch.empty(1, 1))
    gm = make_fx(f, select_decomp_table(), tracing_mode="fake")(*args)
    (d,) = FusePass().run(gm.graph)
    assert d.rerouted is None


def test_int_mm_op_matches_torch_int_mm_at_every_m():
    for M in (1, 7, 16, 17, 33):
        a = torch.randint(-128, 128, (M, 48), dtype=torch.int8)
        b = torch.randint(-128, 128, (40, 48), dtype=torch.int8).t()
        expected = a.int() @ b.int()
        assert torch.equal(fusepass.int_mm(a, b), expected)
        assert torch.equal(torch.ops.fusepass.int_mm(a, b), expected)
