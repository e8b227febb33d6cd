"""The CUDA implementation at real LLM shapes, against the float64 oracle and the CPU op."""

import pytest
import torch

import fusepass
from tests.support.helpers import FP8_MMA_REL, assert_matches_oracle, make_problem, oracle

pytestmark = pytest.mark.gpu

# Llama-3 8B linears (N, K), plus one ragged shape; M from decode to prefill.
NK = [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (1000, 1001)]
MS = [1, 16, 64, 257, 1024, 4096]


def _inputs(p, out_dtype):
    return (p.a, p.b, p.scale_a, p.scale_b, out_dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("N,K", NK)
@pytest.mark.parametrize("M", MS)
def test_gpu_scaled_mm_real_shapes(dtype, M, N, K):
    p = make_problem(M, N, K, dtype, device="cuda", bias_dtype=torch.bfloat16, seed=M + N)
    out = fusepass.scaled_mm(*_inputs(p, torch.bfloat16), p.bias)
    assert out.is_cuda
    assert_matches_oracle(out, p, torch.bfloat16)


@pytest.mark.parametrize("azp", ["tensor", "token"])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1000, 1001)])
@pytest.mark.parametrize("M", [1, 64, 4096])
def test_gpu_scaled_mm_azp_real_shapes(azp, M, N, K):
    p = make_problem(M, N, K, device="cuda", azp=azp, bias_dtype=torch.float32)
    out = fusepass.scaled_mm_azp(*_inputs(p, torch.float16), p.azp_adj, p.azp, p.bias)
    assert_matches_oracle(out, p, torch.float16)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (33, 1000, 1001), (257, 6144, 4096)])
def test_gpu_matches_cpu_reference(dtype, M, N, K):
    """The CUDA kernel and the CPU reference agree to one rounding of the output."""
    for azp in [None, "token"] if dtype == torch.int8 else [None]:
        p = make_problem(M, N, K, dtype, device="cuda", azp=azp, bias_dtype=torch.float32)
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(p).items()}
        if azp is None:
            gpu_out = fusepass.scaled_mm(*_inputs(p, torch.float32), p.bias)
            cpu_out = fusepass.scaled_mm(cpu["a"], cpu["b"], cpu["scale_a"], cpu["scale_b"], torch.float32, cpu["bias"])
        else:
            gpu_out = fusepass.scaled_mm_azp(*_inputs(p, torch.float32), p.azp_adj, p.azp, p.bias)
            cpu_out = fusepass.scaled_mm_azp(cpu["a"], cpu["b"], cpu["scale_a"], cpu["scale_b"], torch.float32,
                                             cpu["azp_adj"], cpu["azp"], cpu["bias"])
        # int8: identical int32 accumulators, so only fp32 epilogue rounding (FMA) differs.
        # fp8: sums in another order, and at reduced precision inside the GPU's MMAs.
        _, mag = oracle(p)
        tol = FP8_MMA_REL if dtype != torch.int8 else 8 * 2.0**-24
        diff = (gpu_out.double() - cpu_out.to("cuda").double()).abs()
        assert (diff <= tol * mag + 2.0**-24 * cpu_out.to("cuda").double().abs()).all()


def test_gpu_m_zero_and_k_zero():
    p = make_problem(0, 4096, 4096, device="cuda")
    assert fusepass.scaled_mm(*_inputs(p, torch.bfloat16)).shape == (0, 4096)
    p = make_problem(3, 5, 0, device="cuda", bias_dtype=torch.float32)
    out = fusepass.scaled_mm(*_inputs(p, torch.float32), p.bias)
    assert torch.equal(out, p.bias.expand(3, 5))


def test_gpu_other_device_index():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    p = make_problem(8, 64, 64, device="cuda:1")
    assert fusepass.scaled_mm(*_inputs(p, torch.float32)).device == torch.device("cuda:1")
