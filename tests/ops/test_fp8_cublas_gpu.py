"""fp8 ``fusepass.scaled_mm`` above FP8_CUBLAS_ABOVE_M rows on an sm90 GPU: cuBLAS's
``torch._scaled_mm`` bit for bit where it takes the operands, the Triton kernel elsewhere,
eagerly (with repeats), in a CUDA graph and compiled with a dynamic M."""

from unittest import mock

import pytest
import torch
from torch._inductor.graph import GraphLowering

import fusepass
from fusepass.kernels.configs import select_config
from fusepass.kernels.launch import launch_scaled_mm
from fusepass.kernels.policy import FP8_CUBLAS_ABOVE_M
from tests.support.helpers import CUBLAS_CALL, assert_matches_oracle, make_problem, require_sm90

pytestmark = pytest.mark.gpu
F8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture(autouse=True)
def _sm90():
    require_sm90("fp8 above FP8_CUBLAS_ABOVE_M")


def _cublas(p, out_dtype):
    M, N = p.a.shape[0], p.b.shape[1]
    rowwise = p.scale_a.numel() > 1 or p.scale_b.numel() > 1
    sa = p.scale_a.reshape(-1, 1).expand(M, 1).contiguous() if rowwise else p.scale_a
    sb = p.scale_b.reshape(1, -1).expand(1, N).contiguous() if rowwise else p.scale_b
    return torch._scaled_mm(p.a, p.b, sa, sb, bias=p.bias, out_dtype=out_dtype)


def _kernel(p, out_dtype):
    M, K = p.a.shape
    cfg = select_config(M, p.b.shape[1], K, F8, p.a.device)
    return launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias, config=cfg)


# (scale_a's shape, scale_b's shape) by recipe: per-token x per-channel, tensor-wise, and the
# two mixes (which cuBLAS refuses: the op spreads the one-element scale to a vector).
RECIPES = {
    "row": lambda M, N: ((M, 1), (1, N)),
    "row 1-D": lambda M, N: ((M,), (N,)),
    "tensor": lambda M, N: ((1,), (1, 1)),
    "tensor 0-d": lambda M, N: ((), ()),
    "tensor x row": lambda M, N: ((1, 1), (1, N)),
    "row x tensor": lambda M, N: ((M,), (1,)),
}


@pytest.mark.parametrize("M,N,K", [(FP8_CUBLAS_ABOVE_M + 1, 4096, 4096), (257, 6144, 4096), (4096, 4000, 4000)])
@pytest.mark.parametrize("recipe,bias_dtype,out_dtype", [
    ("row", BF16, BF16), ("row 1-D", None, torch.float32), ("tensor", None, torch.float16),
    ("tensor 0-d", BF16, BF16), ("tensor x row", None, torch.float32), ("row x tensor", BF16, BF16)], ids=str)
def test_gpu_large_m_runs_cublas(M, N, K, recipe, bias_dtype, out_dtype):
    """Bit for bit cuBLAS's call on two problems of the same layout (the second an eager
    repeat of the recorded call), and within the oracle's bound."""
    sa, sb = RECIPES[recipe](M, N)
    for seed in (0, 1):
        p = make_problem(M, N, K, F8, sa_shape=sa, sb_shape=sb, bias_dtype=bias_dtype, device="cuda", seed=seed)
        out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias)
        assert torch.equal(out, _cublas(p, out_dtype))
        assert_matches_oracle(out, p, out_dtype)


def test_gpu_a_strided_scale_is_copied_then_runs_cublas():
    """A per-token scale that is a column of a wider tensor: the op copies it (``launch.flat``), runs
    cuBLAS, and records nothing (the copy is not the caller's tensor), so each call is right."""
    for seed in (0, 1):
        p = make_problem(512, 4096, 4096, F8, device="cuda", seed=seed)
        p.scale_a = torch.cat([p.scale_a, torch.zeros_like(p.scale_a)], 1)[:, :1]  # stride (2, 1)
        out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, BF16)
        assert torch.equal(out, _cublas(p, BF16))
        assert_matches_oracle(out, p, BF16)


@pytest.mark.parametrize("case", ["M at the limit", "b row-major", "fp32 bias", "bf16 scales", "K % 16",
                                  "misaligned scale"])
def test_gpu_the_kernel_where_cublas_does_not_apply(case):
    M = FP8_CUBLAS_ABOVE_M if case == "M at the limit" else 1024
    K = 4100 if case == "K % 16" else 4096
    p = make_problem(M, 4096, K, F8, bias_dtype=torch.float32 if case == "fp32 bias" else None, device="cuda")
    if case == "b row-major":
        p.b = p.b.contiguous()
    if case == "bf16 scales":
        p.scale_a, p.scale_b = p.scale_a.to(BF16), p.scale_b.to(BF16)
    if case == "misaligned scale":  # contiguous, 4 bytes past a 16-byte boundary
        p.scale_a = torch.cat([torch.zeros(1, device="cuda"), p.scale_a.reshape(-1)])[1:]
    out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, BF16, p.bias)
    assert torch.equal(out, _kernel(p, BF16))
    assert_matches_oracle(out, p, BF16)


def test_gpu_cublas_in_a_cuda_graph():
    p = make_problem(512, 4096, 4096, F8, bias_dtype=BF16, device="cuda")
    out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, BF16, p.bias)  # recorded outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, BF16, p.bias)
    p.a.copy_(make_problem(512, 4096, 4096, F8, device="cuda", seed=3).a)
    g.replay()
    assert torch.equal(captured, _cublas(p, BF16))
    assert not torch.equal(captured, out)


def test_gpu_compiled_dynamic_m_picks_cublas_above_its_m():
    """The op lowered by the fusepass backend: a static M above the limit calls cuBLAS; then a
    dynamic M compiles one graph that runs the kernel at M <= FP8_CUBLAS_ABOVE_M and cuBLAS
    above, each bit for bit the eager op's."""
    torch._dynamo.reset()
    w = make_problem(1, 4096, 4096, F8, device="cuda")
    fn = torch.compile(lambda a, sa: torch.ops.fusepass.scaled_mm(a, w.b, sa, w.scale_b, BF16), backend="fusepass")
    for i, M in enumerate((300, 340, 40, 1000)):
        p = make_problem(M, 4096, 4096, F8, device="cuda", seed=i)
        codes = []
        with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
                torch._inductor.config.patch(fx_graph_cache=False):
            out = fn(p.a, p.scale_a)
        assert torch.equal(out, fusepass.scaled_mm(p.a, w.b, p.scale_a, w.scale_b, BF16))
        assert len(codes) == (1 if i < 2 else 0)  # static, then one dynamic graph for every M
        if codes:
            assert len(CUBLAS_CALL.findall(codes[0])) == 1
            assert ("triton" in codes[0]) == (i == 1)  # the dynamic graph holds the kernel's branches too
