"""The M = 1 kernel (``gemv.py``; Triton's interpreter on CPU, the GPU when there is one)
against the float64 oracle over every epilogue variant and ragged shape, and when the launch
takes it."""

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

from fusepass.kernels import configs, launch, launch_scaled_mm
from fusepass.kernels.configs import GEMV, Config, gemv_config
from fusepass.kernels.gemv import _packed, _rounded, scaled_gemv_kernel
from fusepass.kernels.scaled_mm import scaled_mm_kernel
from tests.support.helpers import assert_matches_oracle, make_problem
from tests.kernels.test_plan import FLAGS, _operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULPS = 1.0 if DEVICE == "cpu" else 0.0  # (the interpreter rounds to bf16 toward zero)

# N ragged over BLOCK_N, K below one block, K ragged over several blocks, K a multiple of the
# block (unmasked loop).
SHAPES = [(17, 33), (100, 1000), (64, 2048), (24, 4096 + 512)]
VARIANTS = [
    dict(sa_shape=(), sb_shape=()),
    dict(sb_shape=(1, 1), bias_dtype=torch.bfloat16),
    dict(bias_dtype=torch.float32),
    dict(azp="tensor", bias_dtype=torch.float32),
    dict(azp="token"),
]


def _run(p, out_dtype, config):
    return launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias, p.azp_adj, p.azp, config=config)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("rows,block_k", [(8, 512), (4, 2048)])
def test_gemv_matches_the_oracle(dtype, N, K, variant, rows, block_k):
    if dtype != torch.int8 and "azp" in VARIANTS[variant]:
        pytest.skip("zero points are int8's")
    p = make_problem(1, N, K, dtype, device=DEVICE, seed=variant, **VARIANTS[variant])
    cfg = gemv_config(N, K, configs.DEFAULT_SMS, dtype)
    out = _run(p, torch.bfloat16, replace(cfg, block_n=rows, block_k=min(cfg.block_k, block_k)))
    assert_matches_oracle(out, p, torch.bfloat16, extra_ulps=BF16_ULPS)


@pytest.mark.parametrize("K,wider", [(700, 900), (1024, 1224)])  # (1024: whole blocks, dp4a where compiled)
def test_gemv_reads_any_strides_of_a_and_rows_of_a_wider_weight(K, wider):
    p = make_problem(1, 40, K, device=DEVICE, bias_dtype=torch.float32)
    wide = torch.zeros((40, wider), dtype=torch.int8, device=DEVICE)
    wide[:, :K] = p.b.t()
    p.b = wide[:, :K].t()  # rows `wider` apart
    spread = torch.zeros((1, 3 * K), dtype=torch.int8, device=DEVICE)
    spread[:, ::3] = p.a
    p.a = spread[:, ::3]  # a.stride(1) == 3
    assert p.b.stride() == (1, wider) and p.a.stride(1) == 3
    assert_matches_oracle(_run(p, torch.float32, gemv_config(40, K, configs.DEFAULT_SMS, torch.int8)), p, torch.float32)


@pytest.mark.parametrize("K", [3000, 4096])  # (a ragged block; whole blocks: dp4a where compiled)
def test_gemv_int32_accumulator_is_exact(K):
    p = make_problem(1, 40, K, device=DEVICE)
    out = launch_scaled_mm(p.a, p.b, None, None, torch.int32, config=gemv_config(40, K, configs.DEFAULT_SMS, torch.int8))
    assert torch.equal(out.cpu(), (p.a.double() @ p.b.double()).to(torch.int32).cpu())


@triton.jit
def _pack_kernel(x_ptr, out_ptr, BLOCK_K: tl.constexpr, AS_FLOAT: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK_K))
    if AS_FLOAT:  # (a quantized row's values, held in fp32)
        x = x.to(tl.float32)
    tl.store(out_ptr + tl.arange(0, BLOCK_K // 4), _packed(x, BLOCK_K))


@pytest.mark.parametrize("as_float", [False, True])
def test_packed_words_are_the_bytes_as_int32(as_float):
    x = torch.tensor([-128, -1, 0, 1, 127, -127, 64, -64] * 8, dtype=torch.int8, device=DEVICE)
    out = torch.empty(len(x) // 4, dtype=torch.int32, device=DEVICE)
    _pack_kernel[(1,)](x, out, BLOCK_K=len(x), AS_FLOAT=as_float)
    assert torch.equal(out.cpu(), x.cpu().view(torch.int32))


def test_dp4a_reads_int8_rows_as_words_where_whole_and_aligned(monkeypatch):
    """gemv.py's DP4A: compiled code on an NVIDIA GPU only; int8, whole blocks of a word or
    more, rows 4 bytes apart from a 16-byte boundary (a real tensor's address, a traced one's
    storage offset: what an eager launch's replay key and Inductor's input checks hold)."""
    monkeypatch.setattr(launch, "INTERPRETED", False)
    buf = torch.zeros(64 * 4100 + 16, dtype=torch.int8)
    w = buf[:64 * 4096].view(64, 4096)
    assert launch.dp4a_rows(w.t(), 512, True, fake=False)
    assert not launch.dp4a_rows(w.t(), 512, False, fake=False)  # a ragged last block
    assert not launch.dp4a_rows(w.t(), 2, True, fake=False)  # a block shorter than a word
    for offset in (1, 4, 8):  # (4 and 8: aligned to a word, not to the replay key's 16 bytes)
        assert not launch.dp4a_rows(buf[offset:offset + 64 * 4096].view(64, 4096).t(), 512, True, fake=False)
    assert launch.dp4a_rows(buf[16:16 + 64 * 4096].view(64, 4096).t(), 512, True, fake=False)
    assert launch.dp4a_rows(buf[:64 * 4100].view(64, 4100)[:, :4096].t(), 512, True, fake=False)  # rows 4100 apart
    assert not launch.dp4a_rows(buf[:64 * 4098].view(64, 4098)[:, :4096].t(), 512, True, fake=False)  # 4098
    assert not launch.dp4a_rows(w.t().view(torch.float8_e4m3fn), 512, True, fake=False)
    with FakeTensorMode():
        fake = torch.empty(64 * 4096 + 16, dtype=torch.int8)
        assert launch.dp4a_rows(fake[:64 * 4096].view(64, 4096).t(), 512, True, fake=True)
        assert launch.dp4a_rows(fake[16:].view(64, 4096).t(), 512, True, fake=True)
        assert not launch.dp4a_rows(fake[4:4 + 64 * 4096].view(64, 4096).t(), 512, True, fake=True)
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert not launch.dp4a_rows(w.t(), 512, True, fake=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(launch, "INTERPRETED", True)
    assert not launch.dp4a_rows(w.t(), 512, True, fake=False)


def test_one_row_with_a_weight_as_stored_takes_the_gemv(sm90):
    a, b, out = _operands(1, 4096, 14336)
    p = launch.plan(gemv_config(4096, 14336, 132, torch.int8), FLAGS, a, b, out, fake=True)
    assert p.kernel is scaled_gemv_kernel and p.gemv and p.grid == (4096 // 4,) and p.split_k == 1
    assert p.constexprs == {**FLAGS, "QUANT": False, "DIVISOR": 1.0, "FLOOR": 0.0, "GATED": False, "FLOOR_FIRST": False,
                            "DP4A": not launch.INTERPRETED, "BLOCK_N": 4, "BLOCK_K": 2048, "EVEN_K": True,
                            "num_warps": 4, "num_stages": 3}


def test_the_launch_picks_the_gemv_for_one_row_of_a_wide_weight_as_stored(monkeypatch):
    """One row of a weight stored (N, K) with at least 2 programs a SM of 4 rows (N >= 1056 on 132
    SMs); not two rows, a weight stored (K, N), or a narrow one (the tiles split K there)."""
    plans = []
    real = launch.plan
    monkeypatch.setattr(launch, "plan", lambda *args: plans.append(real(*args)) or plans[-1])
    monkeypatch.setattr(configs, "sm_count", lambda device: configs.DEFAULT_SMS)
    problems = [make_problem(M, N, 64, device=DEVICE) for M, N in ((1, 1056), (2, 1056), (1, 1052))]
    row_major = make_problem(1, 1056, 64, device=DEVICE)
    row_major.b = row_major.b.contiguous()  # (K, N) with N contiguous: rows of b.T are strided
    for p in problems + [row_major]:
        assert_matches_oracle(_run(p, torch.bfloat16, None), p, torch.bfloat16, extra_ulps=BF16_ULPS)
    assert [p.kernel for p in plans] == [scaled_gemv_kernel] + [scaled_mm_kernel] * 3


def test_a_gemv_config_takes_half_the_rows_below_four_programs_a_sm_and_a_short_k_one_shorter_block():
    """And int8 at 8 rows (dp4a) reads 512 bytes a block, fp8 GEMV's 2048."""
    assert configs.GEMV_PROGRAMS_PER_SM == 4 and GEMV.block_n == 8 and GEMV.block_k == 2048
    int8_wide = replace(GEMV, block_k=configs.GEMV_INT8_WIDE_BLOCK_K)
    assert configs.GEMV_INT8_WIDE_BLOCK_K == 512
    assert gemv_config(6144, 4096, 132, torch.int8) == int8_wide  # 768 programs of 8 rows: 5.8 a SM
    assert gemv_config(6144, 4096, 132, torch.float8_e4m3fn) == GEMV
    assert gemv_config(4224, 4096, 132, torch.int8) == int8_wide  # 528: 4 a SM
    assert gemv_config(4216, 4096, 132, torch.int8) == replace(GEMV, block_n=4)  # 527
    assert gemv_config(4216, 4096, 132, torch.float8_e4m3fn) == replace(GEMV, block_n=4)
    assert gemv_config(28672, 100, 132, torch.int8) == Config(1, 8, 128, num_warps=4, num_stages=3, gemv=True)
    assert gemv_config(6144, 4096 + 256, 132, torch.int8) == GEMV  # (512 does not divide K: no dp4a)


def test_a_gated_row_takes_16_rows_a_program_or_8_where_16_give_fewer_programs_than_sms():
    assert configs.gemv_gated_config(4096, 14336, 132) == replace(GEMV, block_n=16)  # 256 programs
    assert configs.gemv_gated_config(4096, 100, 132) == replace(GEMV, block_n=16, block_k=128)
    assert configs.gemv_gated_config(28672, 4096, 132) == replace(GEMV, block_n=16)  # (GEMV's bytes at any width)
    assert configs.gemv_gated_config(2112, 14336, 132).block_n == 16  # 132 programs
    # (8 rows where 16 leave fewer than a program a SM: a hidden of 2048 runs the kernel, gemv_fills)
    assert configs.gemv_gated_config(2096, 14336, 132) == replace(GEMV, block_n=8)  # 262 programs
    assert configs.gemv_gated_config(2048, 100, 132) == replace(GEMV, block_n=8, block_k=128)
    # (so at least a program a SM wherever the kernel runs)
    for N in range(1000, 5000, 8):
        cfg = configs.gemv_gated_config(N, 4096, configs.DEFAULT_SMS)
        assert not configs.gemv_fills(N, torch.device("cpu")) or -(-N // cfg.block_n) >= configs.DEFAULT_SMS, N


def test_the_gated_launch_takes_the_gated_config(monkeypatch):
    """``launch_gemv_quantized`` with a gate: ``gemv_gated_config``'s rows; without: ``gemv_config``'s."""
    seen = []
    monkeypatch.setattr(launch, "_run", lambda cfg, *a: seen.append(cfg.block_n))
    x, g = torch.randn(1, 14336, dtype=torch.bfloat16), torch.randn(1, 14336, dtype=torch.bfloat16)
    b, sb = torch.zeros(4096, 14336, dtype=torch.int8).t(), torch.ones(4096)
    for gate in (None, g):
        launch.launch_gemv_quantized(x, b, sb, torch.bfloat16, None, 127.5, 1e-7, gate)
    sms = configs.sm_count(x.device)
    assert seen == [gemv_config(4096, 14336, sms, torch.int8).block_n, configs.gemv_gated_config(4096, 14336, sms).block_n]


@pytest.mark.parametrize("M,split_k,row_major", [(2, 1, False), (1, 2, False), (1, 1, True)])
def test_a_gemv_config_refuses_what_its_kernel_cannot_run(sm90, M, split_k, row_major):
    a, b, out = _operands(M, 64, 256)
    b = torch.empty((256, 64), dtype=torch.int8, device="cuda") if row_major else b  # (K, N), N contiguous
    with pytest.raises(ValueError, match="a gemv config needs M = 1, b contiguous along K, a static K and split_k 1"):
        launch.plan(replace(gemv_config(64, 256, 132, torch.int8), split_k=split_k), FLAGS, a, b, out, fake=True)


def test_a_gemv_config_refuses_a_symbolic_k():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
    a = mode.from_tensor(torch.empty(1, 256, dtype=torch.int8), symbolic_context=dynamic)
    K = a.shape[1]
    with mode:
        b = torch.empty((64, K), dtype=torch.int8).t()
        with pytest.raises(ValueError, match="a static K"):
            launch.plan(gemv_config(64, 256, 132, torch.int8), FLAGS, a, b, launch.new_output(a, b, torch.bfloat16), fake=True)


@triton.jit
def _rounding_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    tl.store(out_ptr + offs, _rounded(x, tl.bfloat16), mask=offs < N)


def test_bf16_rounding_is_eagers_bit_for_bit():
    """``gemv._rounded`` to bf16 (a GPU's cast; by its bits under the interpreter) against torch's
    cast: ties to even both ways, the largest float (to infinity), infinities, a NaN, zeros of
    both signs, subnormals, and random values."""
    special = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.4028235e38, -3.4028235e38, float("inf"),
               -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -3 * 2**-135, 2**-126]
    randn = torch.randn(200, generator=torch.Generator().manual_seed(0)) * 1e3
    x = torch.cat([torch.tensor(special), randn]).to(DEVICE)
    out = torch.empty_like(x)
    _rounding_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(torch.bfloat16).float()
    out, want = out.cpu(), want.cpu()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))
