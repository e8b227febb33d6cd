"""The lowering's inputs from the pass: what ``PassConfig`` says reaches the launch code that
``fusepass.passes.lower`` traces (on a fake-CUDA graph, no GPU: the op's implementation is
replaced by a recorder, since the interpreter's kernels cannot be traced)."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.kernels import launch
from fusepass.passes import FusePass, PassConfig
from fusepass.passes import lower as lowering
from tests.passes.data import K, M, N


@pytest.mark.parametrize("outside", [False, True])
def test_pass_config_split_k_outside_cuda_graphs_reaches_the_launch(monkeypatch, outside):
    seen = []

    def recorder(a, b, scale_a, scale_b, out_dtype, bias=None):
        seen.append(launch.SPLIT_OUTSIDE_GRAPHS.get())
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)

    monkeypatch.setattr(lowering, "INTERPRETED", False)
    monkeypatch.setitem(lowering.IMPLS, torch.ops.fusepass.scaled_mm.default, recorder)
    with FakeTensorMode():
        args = (torch.empty(M, K, dtype=torch.int8, device="cuda"), torch.empty(K, N, dtype=torch.int8, device="cuda"),
                torch.empty(M, 1, device="cuda"), torch.empty(1, N, device="cuda"))
        gm = make_fx(lambda a, b, sa, sb: torch._int_mm(a, b).float() * sa * sb,
                     decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    FusePass(PassConfig(split_k_outside_cuda_graphs=outside))(gm.graph)
    assert seen == [outside] and launch.SPLIT_OUTSIDE_GRAPHS.get() is False
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.fusepass.scaled_mm.default]  # lowered


def test_pass_config_is_part_of_the_cache_key():
    assert FusePass(PassConfig(split_k_outside_cuda_graphs=True)).uuid() != FusePass().uuid()
