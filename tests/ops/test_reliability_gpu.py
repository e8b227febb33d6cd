"""GPU robustness of the ops: CUDA graphs, no host syncs, 64-bit offsets."""

import pytest
import torch

from torch.fx.experimental.proxy_tensor import make_fx

import fusepass
from fusepass.kernels.configs import Config
from fusepass.kernels.launch import launch_scaled_mm
from tests.support.helpers import assert_matches_oracle, make_problem, oracle

pytestmark = pytest.mark.gpu

VARIANTS = {
    "int8": dict(dtype=torch.int8),
    "fp8": dict(dtype=torch.float8_e4m3fn),
    "azp_token": dict(azp="token"),
    "azp_tensor": dict(azp="tensor"),
}


def _call(p):
    if p.azp_adj is None:
        return fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.bias)
    return fusepass.scaled_mm_azp(p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.azp_adj, p.azp, p.bias)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M", [1, 33, 512])
def test_cuda_graph_capture_and_replay(variant, M):
    p = make_problem(M, 1000, 1024, device="cuda", bias_dtype=torch.float32, **VARIANTS[variant])
    eager = _call(p)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _call(p)
    for seed in (1, 2):  # new inputs copied into the captured buffers, then replayed
        q = make_problem(M, 1000, 1024, device="cuda", bias_dtype=torch.float32, seed=seed, **VARIANTS[variant])
        for name in ("a", "b", "scale_a", "scale_b", "bias", "azp_adj", "azp"):
            if getattr(p, name) is not None:
                getattr(p, name).copy_(getattr(q, name))
        g.replay()
        torch.cuda.synchronize()
        assert_matches_oracle(out, p, torch.bfloat16)
        assert not torch.equal(out, eager)


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_and_eager_agree_bitwise_at_decode(variant):
    # An eager call and a captured one take the same config (policy.decode_splits: a warm-up
    # outside the capture compiles the kernel the capture launches): the same bits. (int8 sums
    # exactly whatever the split: fp8's fp32 sum is what would tell two configs apart.)
    p = make_problem(16, 4096, 4096, device="cuda", bias_dtype=torch.float32, **VARIANTS[variant])
    eager = _call(p)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _call(p)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_host_device_sync(variant):
    p = make_problem(64, 512, 512, device="cuda", bias_dtype=torch.bfloat16, **VARIANTS[variant])
    empty = make_problem(0, 512, 512, device="cuda")  # (its host-to-device copies sync)
    _call(p)  # compile the kernel first: Triton's first launch may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _call(p)
        fusepass.scaled_mm(empty.a, empty.b, empty.scale_a, empty.scale_b, torch.float16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches_oracle(out, p, torch.bfloat16)


def test_offsets_past_2_31_elements():
    """M*K and M*N both exceed 2**31 elements; checked in row chunks against float64."""
    M, N, K = 2**19 + 37, 4096, 4096
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    p = make_problem(M, N, K, device="cuda", bias_dtype=torch.float32)
    out = _call(p)
    assert M * K > 2**31 and M * N > 2**31
    for start in list(range(0, M, 2**17)) + [M - 5]:  # the last rows too: they live past 2**31
        rows = slice(start, min(start + 2**17, M))
        chunk = type(p)(p.a[rows], p.b, p.scale_a[rows], p.scale_b, p.bias)
        assert_matches_oracle(out[rows], chunk, torch.bfloat16)
    del out


def test_oracle_itself_is_exact_for_int8():
    p = make_problem(3, 8, 16, device="cuda")
    ref, _ = oracle(p)
    torch.testing.assert_close(ref, (p.a.double() @ p.b.double()) * p.scale_a.double() * p.scale_b.double())


# Split-K in one launch: the last program of each tile to arrive adds the slices. Which one is
# last changes from run to run (256 programs for 132 SMs); the fp32 sum must not (it adds in
# slice order), and neither sum may read a slice before it is stored.
SPLIT = Config(16, 32, 128, split_k=8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_split_k_sum_is_the_same_on_every_run(dtype):
    p = make_problem(16, 1024, 4096, dtype, device="cuda", bias_dtype=torch.float32)
    runs = [launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, config=SPLIT) for _ in range(50)]
    assert_matches_oracle(runs[0], p, torch.float32)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])


def test_split_k_is_one_kernel_node_when_traced():
    # (Inductor then adds a fill of the zeroed tickets: benchmarks/NOTES.md, run 8.)
    p = make_problem(16, 1024, 4096, device="cuda", bias_dtype=torch.float32)
    gm = make_fx(lambda *t: launch_scaled_mm(*t, torch.float32, config=SPLIT), tracing_mode="fake")(
        p.a, p.b, p.scale_a, p.scale_b)
    kernels = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    assert len(kernels) == 1, gm.code
