"""The block-wise Triton kernel itself (Triton's interpreter on CPU, the GPU when there is one)
against the float64 oracle, over its tile paths, and its config table."""

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.kernels import blockwise_launch as bl
from fusepass.kernels import launch
from fusepass.kernels.blockwise_launch import check_config, launch_scaled_mm_blockwise, select_config
from fusepass.kernels.configs import Config
from tests.support.blockwise_data import BLOCK, block_oracle, blocks, make_block_problem
from tests.support.helpers import SPLIT_REQUESTS, assert_matches_oracle, fake_cuda_bias, record_split_requests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter rounds fp32 -> bf16 toward zero (see test_scaled_mm_kernel.py).
BF16_ULPS = 1.0 if DEVICE == "cpu" else 0.0

# Small shapes (the interpreter runs each program in numpy): K below one group, K ragged over
# three groups (last 44 wide) with N ragged over three blocks, K whole groups (EVEN_K: no
# masks), and ragged M wrapping around a tile with a last K group one element wide.
CASES = [
    ((1, 17, 33), torch.float32, None),
    ((7, 260, 300), torch.bfloat16, torch.bfloat16),
    ((32, 136, 384), torch.float16, torch.float32),
    ((33, 72, 129), torch.float32, torch.float32),
]


def _check(out, p, out_dtype):
    assert out.shape == (p.a.shape[0], p.b.shape[1]) and out.is_contiguous()
    ulps = BF16_ULPS if out_dtype == torch.bfloat16 else 0.0
    assert_matches_oracle(out, p, out_dtype, extra_ulps=ulps, oracle=block_oracle)


@pytest.mark.parametrize("shape,out_dtype,bias", CASES, ids=[str(c[0]) for c in CASES])
def test_kernel_table_config(shape, out_dtype, bias):
    p = make_block_problem(*shape, bias_dtype=bias, device=DEVICE, seed=shape[0])
    _check(launch_scaled_mm_blockwise(*p.args(out_dtype)), p, out_dtype)


# BLOCK_K below 128: each scale group is 2 or 4 dots; BLOCK_N 256 spans two N blocks, whose
# scales then differ within one tile.
@pytest.mark.parametrize("cfg", [Config(16, 256, 64), Config(32, 32, 32)], ids=["k64_n256", "k32"])
def test_kernel_sub_group_tiles(cfg):
    p = make_block_problem(20, 300, 300, bias_dtype=torch.float32, device=DEVICE, seed=3)
    _check(launch_scaled_mm_blockwise(*p.args(torch.float32), config=cfg), p, torch.float32)


# Split-K: 3 ragged groups over 2 programs (2 + 1), and 4 programs for 3 groups (the last
# program has no group and writes a zero slice); bias added once, by the reduction.
@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_split_k(split_k, out_dtype):
    p = make_block_problem(5, 200, 300, bias_dtype=torch.bfloat16, device=DEVICE, seed=split_k)
    _check(launch_scaled_mm_blockwise(*p.args(out_dtype), config=Config(16, 64, 128, split_k=split_k)), p, out_dtype)


# M = 1 (decode at batch 1), b = w.t() as a weight is stored: the CUDA-core kernel, any block
# a multiple of 128 wide: K ragged inside a block (the last group 44 wide) with N ragged over two
# N blocks, K over two blocks whose second is short a group, and whole blocks (EVEN_K).
@pytest.mark.parametrize("N,K,cfg,bias", [
    (200, 300, Config(1, 8, 256, gemv=True), torch.bfloat16),
    (136, 384, Config(1, 4, 256, gemv=True), None),
    (256, 1024, Config(1, 8, 512, gemv=True), torch.float32),
], ids=["ragged", "short-block", "even"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_m1_kernel(N, K, cfg, bias, out_dtype):
    p = make_block_problem(1, N, K, bias_dtype=bias, device=DEVICE, seed=N)
    _check(launch_scaled_mm_blockwise(*p.args(out_dtype), config=cfg), p, out_dtype)


def test_m1_kernel_is_the_default_where_it_fills_the_gpu(monkeypatch):
    """At M = 1 with b = w.t(), where its programs fill the GPU (as the per-row op's), the
    launcher takes the M = 1 kernel's config, no split; another layout takes the tiles."""
    seen = []
    monkeypatch.setattr(bl, "_run_gemv", lambda cfg, out, *args: seen.append(cfg) or out)
    p = make_block_problem(1, 4096, 256, device=DEVICE)
    launch_scaled_mm_blockwise(*p.args(torch.bfloat16))
    assert seen and seen[0].gemv and seen[0].split_k == 1 and seen[0].block_k % 128 == 0
    seen.clear()
    launch_scaled_mm_blockwise(p.a, p.b.contiguous(), p.scale_a, p.scale_b, torch.bfloat16)  # (b row-major)
    assert not seen


def test_kernel_any_strides():
    """M-major scale_a (cuBLAS), a transposed scale_b view (vLLM), a strided a, a row-major b."""
    p = make_block_problem(9, 140, 200, m_major=True, device=DEVICE, seed=5)
    p.a = torch.cat([p.a, p.a], dim=1)[:, ::2]
    p.b = p.b.contiguous()
    assert p.scale_a.stride() == (1, 9) and p.scale_b.stride() == (1, 2)
    _check(launch_scaled_mm_blockwise(*p.args(torch.float32)), p, torch.float32)


def test_kernel_each_group_and_block_has_its_own_scale():
    """Exact: ones, per-group and per-block powers of two, ragged last group and block."""
    M, N, K = 17, 150, 300
    a = torch.ones(M, K, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.ones(K, N, device=DEVICE).to(torch.float8_e4m3fn)
    sa = (2.0 ** torch.arange(blocks(K), device=DEVICE)).expand(M, -1)  # stride 0 along M: any strides
    sb = (16.0 ** torch.arange(blocks(N), device=DEVICE)).expand(blocks(K), -1)
    expected = (128 + 2 * 128 + 4 * 44) * 16.0 ** (torch.arange(N, device=DEVICE) // BLOCK)
    for cfg in (None, Config(16, 32, 128, split_k=2)):
        assert torch.equal(launch_scaled_mm_blockwise(a, b, sa, sb, torch.float32, config=cfg), expected.expand(M, N))


def test_empty_output_launches_nothing(monkeypatch):
    monkeypatch.setattr(bl, "_run", lambda *a: pytest.fail("launched"))
    p = make_block_problem(0, 130, 200, device=DEVICE)
    assert launch_scaled_mm_blockwise(*p.args(torch.bfloat16)).shape == (0, 130)


def test_config_buckets_and_fit():
    rows = [bl.CONFIGS[i][1] for i in (0, 1, 1, 2, 2, 3, 3, 4, 4, 5)]
    got = [select_config(m, 4096, 4096) for m in (1, 2, 16, 17, 64, 65, 256, 257, 1024, 16384)]
    assert [replace(c, split_k=1) for c in got] == [replace(c, split_k=1) for c in rows]
    small = select_config(3, 17, 33)  # tiles shrunk to the problem; BLOCK_K still divides 128
    assert (small.block_n, small.block_k, small.split_k) == (32, 64, 1)  # one K group: no split
    for row in bl.CONFIGS:
        check_config(row[1])
    tops = [top for top, _ in bl.bucket_choices(4096, 4096)]
    assert tops == [1, 16, 64, 256, None]  # 1024 and up share a config and a split at this N


# The split fills DEFAULT_SMS (no CUDA device asked) x the row's programs per SM, within the
# row's most splits and the K groups: N = 576 has 9 tiles of 64 (M <= 16: 3 x 132 / 9 = 44
# -> 8), N = 4096 has 64 (396 / 64 -> 6), N = 7168 112 (-> 4), a wide N 448 (-> 1); K = 256
# has 2 groups.
@pytest.mark.parametrize("M,N,K,split", [
    (16, 576, 7168, 8), (16, 4096, 14336, 6), (16, 7168, 16384, 4), (16, 28672, 4096, 1), (16, 576, 256, 2),
    (64, 4096, 14336, 4), (256, 4096, 14336, 2), (1024, 576, 7168, 2), (1024, 4096, 14336, 1), (4096, 576, 7168, 1),
])
def test_split_k_fills_the_gpu(M, N, K, split):
    assert select_config(M, N, K).split_k == split


def test_decode_splits_only_where_launches_are_hidden():
    # as configs.decode_unsplit: M <= 16 unsplit for compiled code outside CUDA graphs, larger M keeps its split
    assert [select_config(M, 4096, 14336, split_decode=False).split_k for M in (1, 16, 64)] == [1, 1, 4]
    assert select_config(16, 4096, 14336, split_decode=False) == replace(select_config(16, 4096, 14336), split_k=1)
    assert [c.split_k for _, c in bl.bucket_choices(4096, 14336, split_decode=False)][:3] == [1, 1, 4]


def test_launch_asks_for_the_split_the_policy_gives(monkeypatch):
    """As launch_scaled_mm's: eagerly, traced with a static M, traced with a symbolic one."""
    p = make_block_problem(3, 130, 256, device=DEVICE)
    run = lambda *t: launch_scaled_mm_blockwise(*t, torch.bfloat16)  # noqa: E731
    assert record_split_requests(monkeypatch, bl, run, p.args(torch.bfloat16)[:4]) == SPLIT_REQUESTS


def test_bucket_choices_merge_equal_configs(monkeypatch):
    """A symbolic M gets one cond branch per distinct config (after fitting to N and K)."""
    a, b = Config(16, 32, 128), Config(64, 128, 128)
    monkeypatch.setattr(bl, "CONFIGS", ((1, a, 0, 1), (16, Config(16, 64, 128), 0, 1), (256, b, 0, 1), (None, b, 0, 1)))
    assert bl.bucket_choices(24, 4096) == [(16, Config(16, 32, 128)), (None, Config(64, 32, 128))]


@pytest.mark.parametrize("cfg,message", [
    (Config(16, 32, 48), "block_k must divide the 128-wide scale groups and be >= 32 (32, 64 or 128); got 48"),
    (Config(16, 32, 256), "got 256"),
    (Config(8, 32, 128), "block_m and block_n must be >= 16; got 8, 32"),
    (Config(16, 32, 128, split_k=0), "split_k must be >= 1; got 0"),
    (Config(16, 32, 128, tma=True), "the kernel has no TMA path; got tma=True"),
    (Config(1, 8, 192, gemv=True), "M = 1 config: block_k a multiple of 128, block_n dividing 128 and no split; "
                                   "got 192, 8, split_k 1"),
    (Config(1, 48, 256, gemv=True), "got 256, 48"),
])
def test_bad_configs_are_refused(cfg, message):
    p = make_block_problem(2, 24, 40, device=DEVICE)
    with pytest.raises(ValueError, match="^block-wise .*" + message.replace("(", r"\(").replace(")", r"\)")):
        launch_scaled_mm_blockwise(*p.args(torch.float32), config=cfg)


# --- cuBLAS above CUBLAS_ABOVE_M -------------------------------------------------------------
# What uses_cublas accepts on a pretend sm90 (the ``sm90`` fixture) is what torch 2.11's
# block-wise torch._scaled_mm took on an H200 (the GPU tests run both paths).

def _fake_problem(M, N=512, K=512, *, b_col_major=True, a_offset=0, b_row_pad=0, bias=None, m_major=True):
    cuda = dict(device="cuda")
    a = torch.empty(M * K + a_offset, dtype=torch.float8_e4m3fn, **cuda).as_strided((M, K), (K, 1), a_offset)
    if b_col_major:  # w.t() of an [N, K] weight whose rows are K + b_row_pad apart
        b = torch.empty(N * (K + b_row_pad), dtype=torch.float8_e4m3fn, **cuda).as_strided((K, N), (1, K + b_row_pad))
    else:
        b = torch.empty(K, N, dtype=torch.float8_e4m3fn, **cuda)
    sa = torch.empty(blocks(K), M, **cuda).t() if m_major else torch.empty(M, blocks(K), **cuda)
    sb = torch.empty(blocks(N), blocks(K), **cuda).t()
    return a, b, sa, sb, bias


@pytest.mark.parametrize("change,expected", [
    ({}, True),
    (dict(m_major=False), True),  # scale_a copied into cuBLAS's layout
    (dict(K=1024), True),  # 8 K blocks
    (dict(b_col_major=False), False),  # cuBLAS multiplies a row-major a by a column-major b only
    (dict(a_offset=8), False),  # a's base not 16-byte aligned
    (dict(b_row_pad=8), False),  # b's rows (the weight's) not 16-byte aligned
    (dict(K=528), False),  # K a multiple of 16 but not its 5 K blocks of 4
    (dict(K=640), False),  # 5 K blocks: cuBLASLt pads scale_b's K blocks to a multiple of 4
    (dict(K=128), False),  # 1 K block
    (dict(K=392), False),  # K not a multiple of 16
    (dict(N=520), False),  # N not a multiple of 16
])
def test_uses_cublas_where_cublas_takes_the_layout(sm90, change, expected):
    assert bl.uses_cublas(*_fake_problem(300, **change)[:4], torch.bfloat16) is expected


@pytest.mark.parametrize("out_dtype,bias,expected", [
    (torch.float16, None, True), (torch.float32, None, True),
    (torch.bfloat16, (torch.bfloat16, 0), True),
    (torch.bfloat16, (torch.bfloat16, 1), False),  # a bias not 16-byte aligned
    (torch.bfloat16, (torch.float32, 0), False),  # torch refuses it; cast first, it would round twice
    (torch.float16, (torch.float16, 0), False),  # not measured
    (torch.float32, (torch.float32, 0), False),  # torch refuses a bias with an fp32 output
])
def test_uses_cublas_out_and_bias_dtypes(sm90, out_dtype, bias, expected):
    bias = None if bias is None else fake_cuda_bias(*bias)
    assert bl.uses_cublas(*_fake_problem(300, bias=bias)[:4], out_dtype, bias) is expected


def test_uses_cublas_only_on_sm90_with_cuda_12_9(monkeypatch):
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm100")
    with FakeTensorMode():
        assert not bl.uses_cublas(*_fake_problem(300)[:4], torch.bfloat16)
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm90")
    for version, expected in (("12.8", False), ("12.9", True), ("13.0", True), (None, False)):
        monkeypatch.setattr(torch.version, "cuda", version)
        with FakeTensorMode():
            assert bl.uses_cublas(*_fake_problem(300)[:4], torch.bfloat16) is expected, version
    cpu = make_block_problem(300, 512, 512)
    assert not bl.uses_cublas(cpu.a, cpu.b, cpu.scale_a, cpu.scale_b, torch.bfloat16)


def _traced(M, mode="fake", m_major=True, config=None):
    """The launch traced (CPU tensors, as symbolic sizes need real examples) where cuBLAS applies."""
    p = make_block_problem(M, 512, 512, m_major=m_major)
    gm = make_fx(lambda *t: launch_scaled_mm_blockwise(*t, torch.bfloat16, config=config), tracing_mode=mode)(*p.args(torch.bfloat16)[:4])
    return gm.print_readable(print_output=False)


@pytest.fixture
def cublas_applies(monkeypatch):
    monkeypatch.setattr(bl, "uses_cublas", lambda *args: True)


def test_large_m_traces_to_cublas_small_m_to_the_kernel(cublas_applies):
    large = _traced(20)
    assert large.count("torch.ops.aten._scaled_mm.default") == 1 and "triton_kernel" not in large
    assert "clone" not in large  # M-major scale_a and w_scale.t() go in as they are
    assert "_scaled_mm" not in _traced(16)
    assert "_scaled_mm" not in _traced(257)  # cuBLAS refuses an M that is not a multiple of 4
    assert "clone" in _traced(300, m_major=False)  # a row-major scale_a: copied into cuBLAS's layout
    assert "_scaled_mm" not in _traced(300, config=bl.select_config(300, 512, 512))  # a given config: the kernel


def test_symbolic_m_picks_cublas_at_run_time_above_its_m(cublas_applies, monkeypatch):
    """The buckets above CUBLAS_ABOVE_M become one cuBLAS choice of the cond chain, which
    runs the kernel at their configs where M % 4 != 0."""
    seen = []
    real = bl.by_m
    monkeypatch.setattr(bl, "by_m", lambda choices, *rest: seen.append(choices) or real(choices, *rest))
    code = _traced(300, mode="symbolic")
    assert "torch.ops.higher_order.cond" in code and code.count("torch.ops.aten._scaled_mm.default") == 1
    assert " % 4" in code  # and at M % 4 != 0 the kernel, at run time
    outer, inner = seen  # the buckets up to CUBLAS_ABOVE_M and cuBLAS; the kernel's buckets above it
    assert outer[-2][0] == bl.CUBLAS_ABOVE_M and all(isinstance(cfg, Config) for _, cfg in outer[:-1])
    assert outer[-1] == (None, bl.CublasChoice(tuple(inner)))
    assert inner[0][0] > bl.CUBLAS_ABOVE_M and inner[-1][0] is None and all(isinstance(cfg, Config) for _, cfg in inner)


def test_outer_major_scales():
    s = torch.rand(3, 300).t()  # stride (1, 300): as cuBLAS takes it
    assert bl._outer_major(s) is s
    row_major = s.contiguous()
    copy = bl._outer_major(row_major)
    assert copy.stride() == (1, 300) and torch.equal(copy, row_major)


@pytest.mark.parametrize("N,K", [(200, 384), (256, 1024)], ids=["ragged-n", "even"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_m1_kernel_quantizes_groups(N, K, x_dtype):
    """QUANT: the float row quantized per 128-wide group inside the kernel (a group of zeros at
    the floor, one 1000x larger than the rest) gives the values and scales of
    ``ops.blockwise.quantize_groups``, then the block-wise product."""
    from fusepass.ops.blockwise import quantize_groups

    p = make_block_problem(1, N, K, bias_dtype=torch.bfloat16, device=DEVICE, seed=K)
    g = torch.Generator().manual_seed(N)
    x = torch.randn(1, K, generator=g)
    x[0, :128] = 0.0
    x[0, 128:256] *= 1000.0
    x = x.to(x_dtype).to(DEVICE)
    out = bl.launch_gemv_quantized_groups(x, p.b, p.scale_b, torch.float32, p.bias, 1e-6)
    q, scale_a = quantize_groups(x, 1e-6)
    ref = replace(p, a=q, scale_a=scale_a)
    _check(out, ref, torch.float32)


def test_m1_kernel_quantizing_a_nan_group_gives_nan():
    p = make_block_problem(1, 128, 256, device=DEVICE, seed=1)
    x = torch.randn(1, 256, device=DEVICE)
    x[0, 200] = float("nan")
    assert torch.isnan(bl.launch_gemv_quantized_groups(x, p.b, p.scale_b, torch.float32, None, 1e-6)).all()
