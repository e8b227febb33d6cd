"""fp8 ``fusepass.scaled_mm`` above FP8_CUBLAS_ABOVE_M rows: cuBLAS's ``torch._scaled_mm`` where
it takes the operands (``launch.cublas_takes_fp8``), the kernel elsewhere. What it accepts is
what torch 2.11 took on an H200 (``sm90`` fixture: fake CUDA tensors); the GPU tests
(tests/ops/test_fp8_cublas_gpu.py) run both paths."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.torch_version import TorchVersion

from fusepass.kernels import direct, launch
from fusepass.kernels.configs import Config
from fusepass.kernels.launch import CUBLAS, cublas_takes_fp8, launch_scaled_mm
from fusepass.kernels.policy import FP8_CUBLAS_ABOVE_M
from tests.support.helpers import assert_matches_oracle, fake_cuda_bias, make_problem

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _fake(M=300, N=512, K=512, *, dtype=F8, b_col_major=True, a_offset=0, sa=(300, 1), sb=(1, 512),
          scale_dtype=torch.float32, sa_offset=0, b_broadcast=False):
    cuda = {"device": "cuda"}
    a = torch.empty(M * K + a_offset, dtype=dtype, **cuda).as_strided((M, K), (K, 1), a_offset)
    b = torch.empty(N, K, dtype=dtype, **cuda).t() if b_col_major else torch.empty(K, N, dtype=dtype, **cuda)
    if b_broadcast:  # one weight row for every column
        b = torch.empty(1, K, dtype=dtype, **cuda).expand(N, K).t()
    scale_a = torch.empty(sa, dtype=scale_dtype, **cuda)
    scale_a = torch.empty(scale_a.numel() + sa_offset, dtype=scale_dtype, **cuda).as_strided(
        sa, scale_a.stride(), sa_offset)
    return a, b, scale_a, torch.empty(sb, dtype=scale_dtype, **cuda)


@pytest.mark.parametrize("change,expected", [
    ({}, True),  # per-token x per-channel: row-wise
    ({"sa": (), "sb": ()}, True),  # tensor-wise
    ({"sa": (1,), "sb": (1, 512)}, True),  # mixed: the one-element scale is spread to a vector
    ({"N": 4000, "K": 4000}, True),  # multiples of 16, not of 128
    ({"dtype": torch.float8_e5m2}, False),  # not measured
    ({"dtype": torch.int8}, False),  # cuBLAS's int8 GEMM has no scales
    ({"scale_dtype": BF16}, False),  # torch takes fp32 scales only
    ({"b_col_major": False}, False),  # cuBLAS multiplies a row-major a by a column-major b only
    ({"a_offset": 8}, False),  # a's base not 16-byte aligned
    ({"K": 520}, False),  # K not a multiple of 16
    ({"N": 520}, False),  # N not a multiple of 16
    ({"b_broadcast": True}, False),  # an expanded weight: torch would copy it row-major, then refuse it
    ({"sa_offset": 1}, False),  # a scale vector not 16-byte aligned: not probed
])
def test_cublas_takes_fp8_layouts_and_dtypes(sm90, change, expected):
    if "N" in change:
        change = {**change, "sb": (1, change["N"])}
    assert cublas_takes_fp8(*_fake(**change), BF16) is expected


@pytest.mark.parametrize("out_dtype,bias,expected", [
    (torch.float16, None, True), (torch.float32, None, True),
    (torch.bfloat16, (BF16, 0), True),
    (torch.bfloat16, (BF16, 1), False),  # a bias not 16-byte aligned
    (torch.bfloat16, (torch.float32, 0), False),  # torch refuses it; cast first, it would round twice
    (torch.float16, (torch.float16, 0), False),  # not measured
    (torch.float32, (torch.float32, 0), False),  # torch refuses a bias with an fp32 output
])
def test_cublas_takes_fp8_out_and_bias_dtypes(sm90, out_dtype, bias, expected):
    bias = None if bias is None else fake_cuda_bias(*bias)
    assert cublas_takes_fp8(*_fake(), out_dtype, bias) is expected


def test_cublas_takes_fp8_without_zero_points_on_sm90_with_cuda_12_9(sm90, monkeypatch):
    assert not cublas_takes_fp8(*_fake(), BF16, azp_adj=torch.empty(512, device="cuda"))
    for version, expected in (("12.8", False), ("12.9", True), ("13.0", True), (None, False)):
        monkeypatch.setattr(torch.version, "cuda", version)  # below 12.9: torch's own CUTLASS kernel
        assert cublas_takes_fp8(*_fake(), torch.float32) is expected, version
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm100")
    assert not cublas_takes_fp8(*_fake(), BF16)


def _traced(M, mode="fake", config=None, **problem):
    """The launch traced (CPU tensors, as symbolic sizes need real examples) where cuBLAS applies."""
    p = make_problem(M, 512, 512, F8, **problem)
    fn = lambda *t: launch_scaled_mm(*t, BF16, config=config)  # noqa: E731
    return make_fx(fn, tracing_mode=mode)(p.a, p.b, p.scale_a, p.scale_b).print_readable(print_output=False)


@pytest.fixture
def cublas_applies(monkeypatch):
    monkeypatch.setattr(launch, "cublas_takes_fp8", lambda *args: True)


def test_large_m_traces_to_cublas_small_m_to_the_kernel(cublas_applies):
    large = _traced(FP8_CUBLAS_ABOVE_M + 1)
    assert large.count("torch.ops.aten._scaled_mm.default") == 1 and "triton_kernel" not in large
    assert "_scaled_mm" not in _traced(FP8_CUBLAS_ABOVE_M)
    assert "_scaled_mm" not in _traced(300, config=Config(64, 64, 64))  # a given config: the kernel
    assert "clone" not in large  # per-token [M, 1] and per-channel [1, N]: as cuBLAS takes them
    mixed = _traced(300, sa_shape=(1,))  # a per-tensor scale_a beside a per-channel scale_b
    assert "clone" in mixed and mixed.count("torch.ops.aten._scaled_mm.default") == 1
    assert "expand" not in _traced(300, sa_shape=(1,), sb_shape=(1, 1))  # tensor-wise


def test_symbolic_m_picks_cublas_at_run_time_above_its_m(cublas_applies, monkeypatch):
    seen = []
    real = launch.by_m
    monkeypatch.setattr(launch, "by_m", lambda choices, *rest: seen.append(choices) or real(choices, *rest))
    code = _traced(300, mode="symbolic")
    assert "torch.ops.higher_order.cond" in code and code.count("torch.ops.aten._scaled_mm.default") == 1
    choices = seen[0]  # (then each of its recursions, one bucket fewer)
    assert choices[-2][0] == FP8_CUBLAS_ABOVE_M and choices[-1] == (None, CUBLAS)
    assert all(isinstance(cfg, Config) for _, cfg in choices[:-1])


def test_above_cuts_the_bucket_that_straddles_the_limit():
    c1, c2, c3 = Config(16, 32, 64), Config(64, 64, 64), Config(128, 128, 64)
    assert launch.choices_then([(16, c1), (256, c2), (None, c3)], 64, CUBLAS) == [(16, c1), (64, c2), (None, CUBLAS)]
    assert launch.choices_then([(16, c1), (64, c2), (None, c3)], 64, CUBLAS) == [(16, c1), (64, c2), (None, CUBLAS)]
    assert launch.choices_then([(None, c3)], 64, CUBLAS) == [(64, c3), (None, CUBLAS)]


# The GPU's cuBLAS where there is one; else torch's CPU _scaled_mm, row-wise from torch 2.12
# (2.11's: "Now _scaled_mm only supports per-tensor scaling for CPU backend").
CALL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rowwise_on(device):
    if device == "cpu" and TorchVersion(torch.__version__) < "2.12":
        pytest.skip("torch's CPU _scaled_mm is row-wise from torch 2.12")


@pytest.mark.parametrize("sa_shape,sb_shape", [((300, 1), (1, 512)), ((300,), (512,)), ((1,), (1, 1)), ((1,), (1, 512)),
                                               ((300, 1), (1,))])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(BF16, BF16), (torch.float32, None)])
def test_cublas_call_takes_every_scale_layout(sa_shape, sb_shape, out_dtype, bias_dtype):
    """The call with the scales spread as cuBLAS takes them (on a CPU, torch's own path)."""
    if sa_shape != (1,) or sb_shape != (1, 1):
        _rowwise_on(CALL_DEVICE)
    p = make_problem(300, 512, 512, F8, sa_shape=sa_shape, sb_shape=sb_shape, bias_dtype=bias_dtype,
                     device=CALL_DEVICE)
    out = launch._cublas_fp8_mm(out_dtype, p.a, p.b, p.scale_a, p.scale_b, p.bias)
    assert out.dtype == out_dtype and out.shape == (300, 512)
    assert_matches_oracle(out, p, out_dtype)


def test_cublas_calls_are_recorded_for_eager_repeats():
    _rowwise_on(CALL_DEVICE)
    p, q = (make_problem(96, 64, 128, F8, device=CALL_DEVICE, seed=seed) for seed in (0, 1))
    with direct.recording((p.a, p.b, p.scale_a, p.scale_b)) as launches:
        out = launch.run_cublas(launch._cublas_fp8_mm, BF16, p.a, p.b, p.scale_a, p.scale_b, None)
    ((replay, recorded),) = launches
    assert recorded is out and isinstance(replay, direct.CallReplay)
    again = replay((q.a, q.b, q.scale_a, q.scale_b))
    assert torch.equal(again, launch._cublas_fp8_mm(BF16, q.a, q.b, q.scale_a, q.scale_b))
    assert not torch.equal(again, out)
