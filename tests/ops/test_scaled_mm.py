"""Numerics of the ops' CPU implementation (the reference) against a float64 oracle."""

import itertools

import pytest
import torch

import fusepass
from fusepass.ops import reference
from tests.support.helpers import assert_matches_oracle, make_problem, scale_shapes

OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES_M = [0, 1, 7, 33, 128]
SIZES_NK = [(17, 33), (100, 17), (64, 100)]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M", SIZES_M)
@pytest.mark.parametrize("N,K", SIZES_NK)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_scaled_mm_matches_float64(dtype, M, N, K, out_dtype):
    for i, (sa, sb, bias) in enumerate(
        itertools.product(scale_shapes(M, 0), scale_shapes(N, 1), [None, out_dtype, torch.float32])
    ):
        p = make_problem(M, N, K, dtype, sa_shape=sa, sb_shape=sb, bias_dtype=bias, seed=i)
        out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias)
        assert out.is_contiguous()
        assert_matches_oracle(out, p, out_dtype)


@pytest.mark.parametrize("azp", ["tensor", "token"])
@pytest.mark.parametrize("azp_dtype", [torch.int32, torch.float32], ids=str)
@pytest.mark.parametrize("M", SIZES_M)
@pytest.mark.parametrize("N,K", SIZES_NK)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_scaled_mm_azp_matches_float64(azp, azp_dtype, M, N, K, out_dtype):
    for i, (sa, sb, bias) in enumerate(
        itertools.product(scale_shapes(M, 0), scale_shapes(N, 1), [None, torch.float32])
    ):
        p = make_problem(
            M, N, K, sa_shape=sa, sb_shape=sb, bias_dtype=bias, azp=azp, azp_dtype=azp_dtype, seed=i
        )
        out = fusepass.scaled_mm_azp(
            p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.azp_adj, p.azp, p.bias
        )
        assert_matches_oracle(out, p, out_dtype)


@pytest.mark.parametrize("M,N,K", [(1, 17, 33), (33, 100, 17), (128, 64, 1000)])
def test_int32_accumulator_is_exact(M, N, K):
    # Extreme values: every product is +-2**14, the largest an int8 product can be.
    a = torch.full((M, K), -128, dtype=torch.int8)
    b = torch.full((K, N), -128, dtype=torch.int8)
    acc = reference.accumulate(a, b)
    assert acc.dtype == torch.int32
    assert torch.equal(acc, torch.full((M, N), K * 2**14, dtype=torch.int32))
    p = make_problem(M, N, K)
    assert torch.equal(reference.accumulate(p.a, p.b).double(), p.a.double() @ p.b.double())


def test_int32_zero_point_correction_is_exact():
    # acc and azp * colsum are both large; their integer difference must be exact, which
    # an fp32 subtraction (24-bit mantissa) would not be. It is taken in int64.
    p = make_problem(4, 8, 4096, azp="token")
    acc = reference.accumulate(p.a, p.b)
    corrected = reference.zero_point_correction(acc, p.azp_adj, p.azp)
    assert corrected.dtype == torch.int64
    exact = p.a.long() @ p.b.long() - p.azp.long()[:, None] * p.azp_adj.long()[None, :]
    assert torch.equal(corrected, exact)


# int32 zero-point terms (azp_adj, azp) past what int8 quantization gives, whose sum with the
# accumulator wrapped around int32 (4 - 2**20 * 4096 gave 4): refused, their outputs NaN; the
# largest ones within the bounds, exact; int64 terms exact at any range (acc = 0 here, and
# results fp32 holds exactly).
ZERO_POINTS = {
    "tensor, past": (torch.full((3,), 2**31 - 1, dtype=torch.int32), None, float("nan")),
    "token, past": (torch.full((3,), 4096, dtype=torch.int32), torch.full((2,), 2**20, dtype=torch.int32), float("nan")),
    "token, colsum past": (torch.full((3,), 2**23, dtype=torch.int32), torch.ones(2, dtype=torch.int32), float("nan")),
    "int64, any range": (torch.full((3,), 2**40, dtype=torch.int64), None, -(2.0**40)),  # (exact in int64)
    "tensor, within": (torch.full((3,), 2**30 - 128, dtype=torch.int32), None, -(2**30 - 128.0)),
    "token, within": (torch.full((3,), 2**23 - 1, dtype=torch.int32), torch.full((2,), -128, dtype=torch.int32),
                      2**30 - 128.0),
    "int64, within": (torch.full((3,), 2**30 - 128, dtype=torch.int64), None, -(2**30 - 128.0)),
}


@pytest.mark.parametrize("case", list(ZERO_POINTS))
def test_integer_zero_point_terms_are_exact_within_int8s_bounds_and_refused_past_them(case):
    azp_adj, zp, value = ZERO_POINTS[case]
    a, b = torch.zeros(2, 4, dtype=torch.int8), torch.ones(4, 3, dtype=torch.int8)
    out = fusepass.scaled_mm_azp(a, b, torch.ones(1), torch.ones(1), torch.float32, azp_adj, zp)
    torch.testing.assert_close(out, torch.full((2, 3), value), rtol=0, atol=0, equal_nan=True)


def test_scales_are_multiplied_together_first():
    """``acc * scale_a`` alone passes fp32's range here (-4e40); the value, -4e20, does not."""
    a, b = torch.full((2, 4), 100, dtype=torch.int8), torch.full((4, 3), -100, dtype=torch.int8)
    out = fusepass.scaled_mm(a, b, torch.full((2, 1), 1e36), torch.full((3,), 1e-20), torch.float32)
    torch.testing.assert_close(out, torch.full((2, 3), -4e20), rtol=1e-6, atol=0)


def test_zero_point_matches_dequantized_activations():
    # The identity the azp ops rely on: s_a s_b ((a - z) @ b) == s_a s_b (a @ b - z colsum(b)).
    p = make_problem(9, 24, 40, azp="token")
    shifted = (p.a.double() - p.azp.double()[:, None]) @ p.b.double()
    out = fusepass.scaled_mm_azp(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.azp_adj, p.azp)
    expected = shifted * p.scale_a.double() * p.scale_b.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_k_zero_gives_bias():
    p = make_problem(3, 5, 0, bias_dtype=torch.float32)
    out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias)
    assert torch.equal(out, p.bias.expand(3, 5))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_k_zero_with_infinite_scales_is_zero(dtype, compiled):
    """As PyTorch's own _scaled_mm test of an empty K: an empty sum is zero whatever the scales
    (not inf * 0 = NaN), for both ops, eager and through the backend."""
    a, b = torch.empty(4, 0, dtype=dtype), torch.empty(0, 6, dtype=dtype)
    inf_a, inf_b = torch.full((4, 1), float("inf")), torch.full((1, 6), float("inf"))

    def both(a, b, sa, sb):
        out = [torch.ops.fusepass.scaled_mm(a, b, sa, sb, torch.bfloat16)]
        if a.dtype == torch.int8:
            out.append(torch.ops.fusepass.scaled_mm_azp(a, b, sa, sb, torch.bfloat16, torch.zeros(6, dtype=torch.int32),
                                                        torch.ones(4, dtype=torch.int32)))
        return out

    fn = torch.compile(both, backend="fusepass", fullgraph=True) if compiled else both
    for out in fn(a, b, inf_a, inf_b):
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros(4, 6, dtype=torch.bfloat16))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bf16_and_fp16_scales_are_their_fp32_values(device, scale_dtype):
    p = make_problem(6, 24, 40, device=device, azp="token", bias_dtype=torch.float32)
    sa, sb = p.scale_a.to(scale_dtype), p.scale_b.to(scale_dtype)
    narrow = fusepass.scaled_mm_azp(p.a, p.b, sa, sb, torch.bfloat16, p.azp_adj, p.azp, p.bias)
    wide = fusepass.scaled_mm_azp(p.a, p.b, sa.float(), sb.float(), torch.bfloat16, p.azp_adj, p.azp, p.bias)
    assert torch.equal(narrow, wide)
