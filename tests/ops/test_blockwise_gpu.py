"""fusepass.scaled_mm_blockwise on CUDA: real shapes against the float64 oracle, against cuBLAS's
block-wise torch._scaled_mm within PyTorch's own tolerance for it, every config of the table,
CUDA graphs, and the pass end to end through the fusepass backend."""

from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.graph import GraphLowering

import fusepass
from fusepass.kernels import blockwise_launch as bl
from fusepass.kernels.configs import Config
from tests.support.blockwise_data import BLOCK, block_oracle, make_block_problem
from tests.support.helpers import CUBLAS_CALL, assert_matches_oracle, require_sm90

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
# DeepSeek-V3 linears (kv_a's N = 576 ends in a ragged block), a Llama one, a ragged K.
NK = [(576, 7168), (7168, 2048), (4096, 4096), (1000, 1001)]


@pytest.mark.parametrize("N,K", NK)
@pytest.mark.parametrize("M", [1, 16, 64, 257, 1024, 4096])
def test_gpu_real_shapes(M, N, K):
    p = make_block_problem(M, N, K, bias_dtype=BF16, m_major=True, device="cuda", seed=M + N)
    out = fusepass.scaled_mm_blockwise(*p.args(BF16))
    assert out.is_cuda
    assert_matches_oracle(out, p, BF16, oracle=block_oracle)


@pytest.mark.parametrize("cfg", [row[1] for row in bl.CONFIGS] + [Config(64, 256, 64, num_warps=8), Config(32, 64, 32), Config(16, 32, 128, split_k=6)])
def test_gpu_every_config(cfg):
    p = make_block_problem(300, 1000, 1001, bias_dtype=torch.float32, device="cuda")
    out = bl.launch_scaled_mm_blockwise(*p.args(torch.float32), config=cfg)
    assert_matches_oracle(out, p, torch.float32, oracle=block_oracle)


def _quantize(x: torch.Tensor, rows: int):
    """fp8 data and dequantization scales of x per ``rows`` x 128 block (amax / 448), as
    PyTorch's block-wise tests quantize (tensor_to_scale_block, with the reciprocal scale)."""
    R, C = x.shape
    xb = x.unflatten(1, (-1, BLOCK)).unflatten(0, (-1, rows))
    s = xb.abs().amax(dim=(1, 3), keepdim=True).float() / torch.finfo(torch.float8_e4m3fn).max
    q = (xb / s).to(torch.float8_e4m3fn).flatten(2, 3).flatten(0, 1)
    return q, s.flatten(2, 3).flatten(0, 1)  # [R, C], [R / rows, C / 128]


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=str)
@pytest.mark.parametrize("M,N,K", [(256, 768, 512), (256, 128, 256), (1, 256, 128), (16, 7168, 2048)])
def test_gpu_matches_cublas_blockwise(M, N, K, out_dtype):
    """The Triton kernel (the op runs cuBLAS's GEMM above CUBLAS_ABOVE_M) under PyTorch's check
    of its block-wise _scaled_mm (test_scaled_mm_vs_emulated_block_wise):
    cosine similarity >= 0.999 and atol/rtol 6e-1/7e-2 (bf16) or 7e-1/2e-3 (fp32) against the
    emulated (dequantized, exact) product, which cuBLAS meets too; and no larger an error than
    cuBLAS's (5% slack: at K = 256 both err 1.79). cuBLAS is the less exact of the two: at (16, 7168, 2048) fp32 its largest
    error is 3.5 against ours 0.0017 (|out| up to 8e3, H200, cuBLAS of torch 2.11+cu130)."""
    torch.manual_seed(42)
    x = torch.randn(M, K, device="cuda", dtype=out_dtype).pow(3)
    y = torch.randn(N, K, device="cuda", dtype=out_dtype).pow(3)
    xq, xs = _quantize(x, 1)
    yq, ys = _quantize(y, BLOCK)
    xs = xs.t().contiguous().t()  # 1x128 scales are outer-dim-major for cuBLAS
    try:
        theirs = torch._scaled_mm(xq, yq.t(), xs, ys.t(), out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError) as e:  # sm90 and cuBLAS >= 12.9 only
        pytest.skip(f"torch._scaled_mm has no block-wise mode here: {str(e).splitlines()[0]}")
    ours = bl.launch_scaled_mm_blockwise(xq, yq.t(), xs, ys.t(), out_dtype, config=bl.select_config(M, N, K, xq.device))
    emulated = ((xq.double() * xs.double().repeat_interleave(BLOCK, 1))
                @ (yq.double() * ys.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).t())
    atol, rtol = (6e-1, 7e-2) if out_dtype == BF16 else (7e-1, 2e-3)
    for out in (ours, theirs):
        cos = torch.nn.functional.cosine_similarity(out.flatten().double(), emulated.flatten(), dim=0)
        assert float(cos) >= 0.999
    torch.testing.assert_close(ours.double(), emulated, atol=atol, rtol=rtol)
    # Both accumulate a 128-wide group in the fp8 MMA's own precision; cuBLAS carries it further.
    assert (ours.double() - emulated).abs().max() <= 1.05 * (theirs.double() - emulated).abs().max()
    cos_hp = torch.nn.functional.cosine_similarity(ours.flatten().float(), (x @ y.t()).flatten().float(), dim=0)
    assert float(cos_hp) >= 0.999  # the scaling is right, not only consistent with cuBLAS's


def _cublas(p, out_dtype):
    sa = p.scale_a.t().contiguous().t()  # cuBLAS takes M-major 1x128 scales
    return torch._scaled_mm(p.a, p.b, sa, p.scale_b, bias=p.bias, out_dtype=out_dtype)


def _kernel(p, out_dtype):
    M, K = p.a.shape
    cfg = bl.select_config(M, p.b.shape[1], K, p.a.device)
    return bl.launch_scaled_mm_blockwise(*p.args(out_dtype), config=cfg)


def _needs_cublas():
    require_sm90("the block-wise product above CUBLAS_ABOVE_M")


@pytest.mark.parametrize("M,N,K", [(260, 576, 7168), (1024, 4096, 4096), (4096, 7168, 2048), (20, 256, 512)])
@pytest.mark.parametrize("m_major,bias_dtype,out_dtype", [(True, None, BF16), (False, BF16, BF16),
                                                          (False, None, torch.float32), (True, None, torch.float16)], ids=str)
def test_gpu_large_m_runs_cublas(M, N, K, m_major, bias_dtype, out_dtype):
    """Above CUBLAS_ABOVE_M on an sm90 GPU: cuBLAS's block-wise GEMM, bit for bit, with a
    row-major scale_a copied into its layout; a second call with other data of the same
    layout (an eager repeat of the recorded cuBLAS call) is right too."""
    _needs_cublas()
    for seed in (0, 1):
        p = make_block_problem(M, N, K, bias_dtype=bias_dtype, m_major=m_major, device="cuda", seed=seed)
        out = fusepass.scaled_mm_blockwise(*p.args(out_dtype))
        assert torch.equal(out, _cublas(p, out_dtype))
        assert_matches_oracle(out, p, out_dtype, oracle=block_oracle)


def test_gpu_cublas_with_row_strided_operands_and_in_a_cuda_graph():
    """An activation and a weight that are column slices of wider ones (rows K + 128 apart),
    and the cuBLAS path captured in a CUDA graph, replayed on new data."""
    _needs_cublas()
    M, N, K = 64, 4096, 4096
    p = make_block_problem(M, N, K + 128, m_major=True, device="cuda")
    q = make_block_problem(M, N, K, m_major=True, device="cuda")
    q.a, q.b = p.a[:, :K], p.b[:K]  # strides (K + 128, 1) and (1, K + 128)
    out = fusepass.scaled_mm_blockwise(*q.args(BF16))
    assert torch.equal(out, _cublas(q, BF16))
    assert_matches_oracle(out, q, BF16, oracle=block_oracle)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fusepass.scaled_mm_blockwise(*q.args(BF16))
    p.a.copy_(make_block_problem(M, N, K + 128, device="cuda", seed=5).a)  # q.a's data changes with it
    g.replay()
    assert_matches_oracle(captured, q, BF16, oracle=block_oracle)
    assert not torch.equal(captured, out)


@pytest.mark.parametrize("case", ["b row-major", "fp32 bias", "fp16 bias", "K % 16", "K blocks % 4", "M % 4"])
def test_gpu_large_m_runs_the_kernel_where_cublas_does_not_apply(case):
    M = 1025 if case == "M % 4" else 1024
    K = {"K % 16": 4100, "K blocks % 4": 640}.get(case, 4096)
    bias_dtype = {"fp32 bias": torch.float32, "fp16 bias": torch.float16}.get(case)
    out_dtype = torch.float16 if case == "fp16 bias" else BF16
    p = make_block_problem(M, 4096, K, bias_dtype=bias_dtype, device="cuda")
    if case == "b row-major":
        p.b = p.b.contiguous()
    out = fusepass.scaled_mm_blockwise(*p.args(out_dtype))
    assert torch.equal(out, _kernel(p, out_dtype))
    assert_matches_oracle(out, p, out_dtype, oracle=block_oracle)


def test_gpu_cuda_graph_replay():
    p = make_block_problem(16, 576, 7168, device="cuda")
    out = fusepass.scaled_mm_blockwise(*p.args(BF16))  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fusepass.scaled_mm_blockwise(*p.args(BF16))
    p.a.copy_(make_block_problem(16, 576, 7168, device="cuda", seed=9).a)
    g.replay()
    assert_matches_oracle(captured, p, BF16, oracle=block_oracle)
    assert not torch.equal(captured, out)


def _lines_naming(word, code):
    return [line.strip() for line in code.splitlines() if word in line and not line.lstrip().startswith("#")]


def _dequant_linear(x, sx, w, sw):
    k, n = x.shape[-1], w.shape[0]
    xd = (x.to(BF16) * sx.repeat_interleave(BLOCK, -1)[..., :k]).to(BF16)
    wd = (w.to(BF16) * sw.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]).to(BF16)
    return torch.nn.functional.linear(xd, wd)


@pytest.mark.parametrize("M", [1, 16, 300])
def test_gpu_backend_fuses_the_dequant_form(M):
    """The fusepass backend (Inductor launches the lowered kernel) on the dequantize form; a
    second and a third M through the same compiled graph (automatic dynamic M: the cond per
    bucket, and on sm90 a cuBLAS branch above CUBLAS_ABOVE_M, taken where M % 4 == 0)."""
    torch._dynamo.reset()
    counters["fusepass"].clear()
    p = make_block_problem(M, 576, 7168, device="cuda")
    w, sw = p.b.t(), p.scale_b.t()
    fn = torch.compile(lambda x, sx: _dequant_linear(x, sx, w, sw), backend="fusepass")
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    for i, m in enumerate((M, M + 40, M + 39)):
        q = make_block_problem(m, 576, 7168, device="cuda", seed=i)
        q.b, q.scale_b = p.b, p.scale_b  # the compiled function's weight
        codes = []
        with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
                torch._inductor.config.patch(fx_graph_cache=False):  # the code as compiled here
            out = fn(q.a, q.scale_a)
        assert_matches_oracle(out, q, BF16, oracle=block_oracle)
        # compiled for the first M (static) and the second (dynamic); the third reuses it
        assert len(codes) == (1 if i < 2 else 0)
        if i < 2:
            calls = CUBLAS_CALL.findall(codes[0])
            assert bool(calls) == (sm90 and (i == 1 or M > bl.CUBLAS_ABOVE_M)), (calls, _lines_naming("scaled_mm", codes[0]))
    assert counters["fusepass"]["dequant_mm_blockwise"] >= 1


@pytest.mark.parametrize("M,K,fused", [(8, 512, True), (80, 512, False), (80, 640, True)])
def test_gpu_backend_scaled_mm_fp8_rule(M, K, fused):
    """Fused at M <= 64, kept on cuBLAS above; but at 5 K blocks at every M: there cuBLAS's
    block-wise GEMM is wrong (benchmarks/NOTES.md, run 15)."""
    torch._dynamo.reset()
    counters["fusepass"].clear()
    p = make_block_problem(M, 768, K, m_major=True, device="cuda")
    try:
        eager = torch._scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype=BF16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm has no block-wise mode here: {str(e).splitlines()[0]}")
    fn = torch.compile(lambda *t: torch._scaled_mm(*t, out_dtype=BF16), backend="fusepass")
    out = fn(p.a, p.b, p.scale_a, p.scale_b)
    assert counters["fusepass"].get("scaled_mm_blockwise", 0) == int(fused)
    if fused:
        assert_matches_oracle(out, p, BF16, oracle=block_oracle)
    else:  # the same cuBLAS call
        torch.testing.assert_close(out, eager)
