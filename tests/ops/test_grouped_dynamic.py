"""``fusepass.scaled_grouped_mm_dynamic``: a mixture of experts' float rows (given a gate, the
SiLU-mul of gate and up) quantized per row, then ``scaled_grouped_mm``. The row kernel quantizing
its rows (``grouped_gemv_kernel``'s QUANT and GATED) against the quantization then the op: in
Triton's interpreter bit for bit, on a GPU within a step of the quantization (Triton's ``exp``);
above the row kernel's rows, the rows quantized by their own kernel then the sorted blocks, alike;
the unfused path elsewhere; NaN rows; opcheck; an error naming the argument for every bad input."""

import pytest
import torch

import fusepass
from fusepass.integrations.linear import SCALE_EPS
from fusepass.kernels.grouped_launch import Recipe, grouped_quantizes, launch_scaled_grouped_mm
from fusepass.kernels.policy import GROUPED_ROWS_MAX_M
from fusepass.ops.dynamic import quantize_rows
from tests.support.grouped_data import make_grouped
from tests.support.helpers import DIVISOR

OP = torch.ops.fusepass.scaled_grouped_mm_dynamic.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, I8, F8 = torch.bfloat16, torch.int8, torch.float8_e4m3fn


def _problem(M, E, N, K, dtype, seed=0, device=DEVICE):
    """(x, gate, p): float rows and gates of a gated expert MLP's scale, and the grouped problem
    (its ``a`` unused) whose weights, scales, ids, bias and row weights the op takes."""
    p = make_grouped(M, 1, E, N, K, dtype, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, gate = (torch.randn(M, K, generator=g).mul(3).to(BF16).to(device) for _ in range(2))
    return x, gate, p


def _unfused(x, gate, p, out_dtype=torch.float32, floor_first=None, floor=SCALE_EPS):
    """The quantization (of ``silu(gate) * x`` given a gate), then ``scaled_grouped_mm``'s launch
    (the kernel's fp8 sums in the fused kernel's order; the CPU reference's are another's)."""
    row = x if gate is None else torch.nn.functional.silu(gate) * x
    q, s = quantize_rows(row, p.b.dtype, DIVISOR[p.b.dtype], floor, floor_first)
    return launch_scaled_grouped_mm(q, p.b, s, p.scale_b, p.expert_ids, out_dtype, p.bias, p.row_weights), s


def _fused(x, gate, p, out_dtype=torch.float32, floor_first=None, floor=SCALE_EPS):
    if DEVICE == "cpu":  # (the op's CPU path is the unfused one: the row kernel, in the interpreter)
        return launch_scaled_grouped_mm(x, p.b, None, p.scale_b, p.expert_ids, out_dtype, p.bias, p.row_weights,
                                        recipe=Recipe(DIVISOR[p.b.dtype], floor, floor_first, gate))
    return fusepass.scaled_grouped_mm_dynamic(x, p.b, p.scale_b, p.expert_ids, out_dtype, p.bias, p.row_weights,
                                              DIVISOR[p.b.dtype], floor, gate, floor_first)


def _assert_within_a_step(out, want, s, p):
    """Bit for bit in the interpreter; on a GPU a gated value may round to a neighbour (Triton's
    ``exp``), moving an output by one quantization step of the row times the weight column."""
    if DEVICE == "cpu":
        assert torch.equal(out, want)
        return
    e = p.expert_ids.long()
    col = p.b.float().abs().amax(1)[e] * p.scale_b.float()[e] * p.row_weights.float()[:, None]  # [M, N]
    step = s.reshape(-1, 1) * col * (1 if p.b.dtype == I8 else 32)
    assert ((out - want).abs() <= 2 * step + 1e-5 * want.abs()).all()


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("gated", [False, True], ids=["rows", "gated"])
@pytest.mark.parametrize("M,E,N,K", [(8, 16, 48, 256), (5, 4, 40, 200), (1, 8, 17, 33)])
def test_the_row_kernel_quantizing_its_rows_is_the_quantization_then_the_op(dtype, gated, M, E, N, K):
    x, gate, p = _problem(M, E, N, K, dtype, seed=M + K)
    gate = gate if gated else None
    assert grouped_quantizes(x, p.b, p.scale_b, p.expert_ids).rows
    want, s = _unfused(x, gate, p)
    _assert_within_a_step(_fused(x, gate, p), want, s, p)


def test_floor_first_picks_the_scales_order():
    """A floor of 0.01 and rows of amax about 1: floored first the scale is amax / 127.5 (0.0078),
    divided first the floor (0.01), so the two orders give other outputs; each as the recipe's."""
    x, gate, p = _problem(4, 8, 32, 64, I8, seed=7)
    x = x / x.float().abs().amax(1, keepdim=True).to(x.dtype)  # (amax 1 before the gate)
    outs = []
    for floor_first in (True, False):
        want, s = _unfused(x, None, p, floor_first=floor_first, floor=0.01)
        assert torch.allclose(s.flatten(), torch.full((4,), 1 / 127.5 if floor_first else 0.01, device=s.device),
                              rtol=1e-2)
        outs.append(_fused(x, None, p, floor_first=floor_first, floor=0.01))
        _assert_within_a_step(outs[-1], want, s, p)
    assert not torch.allclose(outs[0], outs[1])


def _unfused_op(x, gate, p, out_dtype):
    q, s = quantize_rows(torch.nn.functional.silu(gate) * x, p.b.dtype, DIVISOR[p.b.dtype], SCALE_EPS)
    return fusepass.scaled_grouped_mm(q, p.b, s, p.scale_b, p.expert_ids, out_dtype, p.bias, p.row_weights)


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("gated", [False, True], ids=["rows", "gated"])
@pytest.mark.parametrize("K", [64, 200])
def test_more_rows_than_the_row_kernel_takes_are_quantized_first_then_the_blocks(dtype, gated, K):
    """Above the row kernel's rows, ``quantize_rows_kernel`` quantizes the rows (one launch), then
    the sorted blocks: the quantization then the op (bit for bit in the interpreter)."""
    x, gate, p = _problem(GROUPED_ROWS_MAX_M + 8, 8, 32, K, dtype, seed=3 + K)
    gate = gate if gated else None
    tiles = grouped_quantizes(x, p.b, p.scale_b, p.expert_ids, gate)
    assert tiles is not None and not tiles.rows
    want, s = _unfused(x, gate, p)
    _assert_within_a_step(_fused(x, gate, p), want, s, p)


def test_a_weight_not_contiguous_along_k_runs_unfused_on_the_row_kernel_and_quantized_first_on_the_blocks():
    x, gate, p = _problem(4, 8, 32, 64, I8, seed=4)
    p.b = p.b.contiguous()  # ([E, K, N] row-major: not the row kernel's loop)
    assert not grouped_quantizes(x, p.b, p.scale_b, p.expert_ids)
    want = _unfused_op(x, gate, p, torch.float32)
    got = fusepass.scaled_grouped_mm_dynamic(x, p.b, p.scale_b, p.expert_ids, torch.float32, p.bias, p.row_weights,
                                             127.5, SCALE_EPS, gate)
    assert torch.equal(got, want)
    x, gate, p = _problem(GROUPED_ROWS_MAX_M + 1, 8, 32, 64, I8, seed=4)
    p.b = p.b.contiguous()
    tiles = grouped_quantizes(x, p.b, p.scale_b, p.expert_ids, gate)
    assert tiles is not None and not tiles.rows
    want, s = _unfused(x, gate, p)
    _assert_within_a_step(_fused(x, gate, p), want, s, p)


def test_gate_and_up_cut_from_one_output_are_quantized_in_the_kernel_and_other_strides_unfused():
    x, gate, p = _problem(4, 8, 32, 64, I8, seed=10)
    h = torch.cat([gate, x], 1)  # (a gate/up projection's output: its halves share their strides)
    g, up = h.chunk(2, dim=-1)
    assert grouped_quantizes(up, p.b, p.scale_b, p.expert_ids, g).rows
    want, s = _unfused(x, gate, p)
    _assert_within_a_step(_fused(up, g, p), want, s, p)
    # a contiguous gate beside a strided x: the kernel reads both by x's strides, so the op runs unfused
    assert not grouped_quantizes(up, p.b, p.scale_b, p.expert_ids, gate)
    got = fusepass.scaled_grouped_mm_dynamic(up, p.b, p.scale_b, p.expert_ids, torch.float32, p.bias, p.row_weights,
                                             127.5, SCALE_EPS, gate)
    assert torch.equal(got, _unfused_op(x, gate, p, torch.float32))


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("where,value", [("x", float("nan")), ("x", float("inf")), ("gate", float("nan")),
                                         ("gate", -float("inf"))])
@pytest.mark.parametrize("M", [4, GROUPED_ROWS_MAX_M + 8], ids=["row-kernel", "blocks"])
def test_a_nan_or_an_infinity_in_a_row_gives_a_nan_row(dtype, where, value, M):
    x, gate, p = _problem(M, 8, 32, 64, dtype, seed=5)
    (x if where == "x" else gate)[2, 9] = value
    p.expert_ids[0] = 8  # (an id outside [0, E): NaN, as the op's)
    out = _fused(x, gate, p)
    assert out[[0, 2]].isnan().all() and not out[[1, 3]].isnan().any() and not out[4:].isnan().any()


def test_an_empty_k_gives_the_bias_alone():
    x, gate, p = _problem(3, 4, 8, 16, I8, seed=6, device="cpu")
    x, gate, p.b = x[:, :0], gate[:, :0], p.b[:, :0]
    out = fusepass.scaled_grouped_mm_dynamic(x, p.b, p.scale_b, p.expert_ids, torch.float32, p.bias, p.row_weights,
                                             gate=gate)
    assert torch.equal(out, p.bias[p.expert_ids] * p.row_weights[:, None])


def test_opcheck():
    x, gate, p = _problem(5, 4, 24, 40, I8, seed=8, device="cpu")
    for args in ((x, p.b, p.scale_b, p.expert_ids, BF16),
                 (x, p.b, p.scale_b, p.expert_ids, torch.float32, p.bias, p.row_weights, 127.0, 1e-8, gate, True)):
        torch.library.opcheck(OP, args)


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.zeros(5, 40, dtype=I8)), TypeError, "`x` must have dtype bfloat16, float16, float32"),
    (dict(x=torch.zeros(40, dtype=BF16), gate=None), ValueError, "`x` must be [M, K] and `b` [E, K, N]"),
    (dict(b=torch.zeros(40, 24, dtype=I8)), ValueError, "`x` must be [M, K] and `b` [E, K, N]"),
    (dict(b=torch.zeros(4, 40, 24, dtype=BF16)), TypeError, "`b` must have dtype int8, float8_e4m3fn"),
    (dict(scale_b=torch.ones(4, 23)), ValueError, "`scale_b` must be per expert and channel [E, N] = [4, 24]"),
    (dict(expert_ids=torch.zeros(10, dtype=torch.int64)), ValueError, "one expert a row of `x` (M = 5)"),
    (dict(expert_ids=torch.zeros(5)), TypeError, "`expert_ids` must have dtype int32, int64"),
    (dict(divisor=0.0), ValueError, "`divisor` must be > 0 and `floor` >= 0; got 0.0"),
    (dict(floor=-1.0), ValueError, "`floor` >= 0; got 127.5, -1.0"),
    (dict(out_dtype=torch.int8), TypeError, "`out_dtype` must be one of bfloat16, float16, float32"),
    (dict(gate=torch.zeros(5, 40)), ValueError, "`gate` must have `x`'s dtype and shape"),
    (dict(bias=torch.zeros(4, 23)), ValueError, "`bias` must be [E, N] = [4, 24]"),
    (dict(row_weights=torch.ones(4)), ValueError, "`row_weights` must be [M] or [M, 1] with M = 5"),
    (dict(floor_first=1), ValueError, "`floor_first` must be None, True or False; got 1"),
])
def test_bad_inputs_are_refused_by_name(change, error, message):
    x, gate, p = _problem(5, 4, 24, 40, I8, seed=9, device="cpu")
    args = dict(x=x, b=p.b, scale_b=p.scale_b, expert_ids=p.expert_ids, out_dtype=BF16, bias=p.bias,
                row_weights=p.row_weights, divisor=127.5, floor=SCALE_EPS, gate=gate, floor_first=None) | change
    with pytest.raises(error) as e:
        fusepass.scaled_grouped_mm_dynamic(*args.values())
    assert message in str(e.value) and "fusepass.scaled_grouped_mm_dynamic" in str(e.value), str(e.value)


def test_the_launch_refuses_a_recipe_it_cannot_take():
    from fusepass.kernels.policy import GroupedTiles

    x, gate, p = _problem(4, 8, 32, 256, F8, seed=11, device="cpu")
    recipe = Recipe(448.0, SCALE_EPS, None, gate)
    with pytest.raises(ValueError, match="a recipe .* on the row kernel b contiguous along K.*got tiles rows"):
        launch_scaled_grouped_mm(x, p.b.contiguous(), None, p.scale_b, p.expert_ids, torch.float32, recipe=recipe,
                                 tiles=GroupedTiles(True, 1, 8, 64, 2, 3))
    blocks = torch.ones(8, 2, 1)  # (per 128x128 block: the groups' own quantization, not a row's)
    with pytest.raises(ValueError, match="a recipe .* needs scales per channel or per expert.*scale_b \\(8, 2, 1\\)"):
        launch_scaled_grouped_mm(x, p.b, None, blocks, p.expert_ids, torch.float32, recipe=recipe,
                                 tiles=GroupedTiles(False, 16, 32, 64, 4, 2))
    up = torch.cat([gate, x], 1)[:, 256:]  # (rows of stride 512 beside a contiguous gate: one set of strides)
    odd = "a gate of the rows' strides.*rows' strides \\(512, 1\\), gate's \\(256, 1\\)"
    with pytest.raises(ValueError, match=odd):
        launch_scaled_grouped_mm(up, p.b, None, p.scale_b, p.expert_ids, torch.float32, recipe=recipe,
                                 tiles=GroupedTiles(False, 16, 32, 64, 4, 2))
