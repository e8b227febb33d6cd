"""``quantize_rows_kernel`` (``kernels/quantize.py``, launched by ``grouped_launch.quantized_rows``):
float rows (given a gate, ``silu(gate) * x``) quantized per row by ``ops.dynamic.quantize_rows``'
recipes. Bit for bit against the ATen ops on the CPU (correctly rounded divisions: a GPU's
``tensor / scalar`` multiplies by the reciprocal), the SiLU-mul as eager rounds it; on a GPU
the gated rows within one step of the grid (Triton's ``exp``)."""

import pytest
import torch

from fusepass.integrations.linear import SCALE_EPS
from fusepass.kernels import grouped_launch
from fusepass.kernels.grouped_launch import Recipe, quantized_rows
from fusepass.ops.dynamic import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I8, F8, BF16 = torch.int8, torch.float8_e4m3fn, torch.bfloat16


def _rows(M, K, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(M, K, generator=g) * 3).to(dtype).to(DEVICE) for _ in range(2)]


def _check(x, gate, dtype, divisor, floor=SCALE_EPS, floor_first=None, **launch):
    q, s = quantized_rows(x, dtype, Recipe(divisor, floor, floor_first, gate), fake=False, **launch)
    row = x if gate is None else torch.nn.functional.silu(gate) * x
    want_q, want_s = quantize_rows(row.cpu(), dtype, divisor, floor, floor_first)
    assert q.dtype == dtype and q.shape == x.shape and q.is_contiguous() and s.shape == (x.shape[0],)
    q, s, want_s = q.cpu(), s.cpu(), want_s.flatten()
    finite = want_s.isfinite()  # (a row holding a NaN: its scale NaN, its values undefined)
    assert torch.equal(s.isnan(), want_s.isnan())
    q, want_q, s, want_s = q[finite].float(), want_q[finite].float(), s[finite], want_s[finite]
    if DEVICE == "cpu" or gate is None:
        assert torch.equal(s, want_s) and torch.equal(q, want_q)
    else:  # (a gated value may round to a neighbour: one step of the grid, and the amax with it)
        torch.testing.assert_close(s, want_s, rtol=1e-2, atol=0)
        assert ((q - want_q).abs() <= (1.0 if dtype == I8 else 32.0)).all()


@pytest.mark.parametrize("dtype,divisor", [(I8, 127.5), (I8, 127.0), (F8, 448.0)], ids=["int8", "int8-127", "fp8"])
@pytest.mark.parametrize("gated", [False, True], ids=["rows", "gated"])
@pytest.mark.parametrize("M,K", [(40, 768), (3, 1), (5, 100), (3, grouped_launch.QUANTIZE_BLOCK_K),
                                 (2, grouped_launch.QUANTIZE_BLOCK_K - 1), (2, grouped_launch.QUANTIZE_BLOCK_K + 40)])
def test_rows_are_quantize_rows_of_the_rows(dtype, divisor, gated, M, K):
    """Rows in whole pieces (768: 3 of 256; 4096: 16, a row a program), ragged (100: 7 of 16, the
    last masked; 4095: 16 of 256), one element, and more than a block (two reads of the row); M a
    whole number of programs' rows and not."""
    x, gate = _rows(M, K, seed=M + K)
    _check(x, gate if gated else None, dtype, divisor)


@pytest.mark.parametrize("K", [768, 96, 100])
@pytest.mark.parametrize("piece,slots,warps", [(256, 4, 4), (256, 16, 8), (32, 4, 2), (64, 32, 4)])
def test_rows_as_pieces_in_slots(K, piece, slots, warps):
    """A row in pieces (768: 3 of 256, 12 of 64 or 24 of 32; 96: 3 of 32; 100, ragged: 7 of 16,
    or 4 of 32 or one of 128, the last masked), a row a program or several, slots left unused;
    13 rows, the last program's ragged; NaNs in a row's first and last pieces, and in the last row."""
    x, gate = _rows(13, K, seed=K + slots)
    x[4, 7] = x[7, K - 1] = x[12, K // 2] = float("nan")
    for dtype, divisor in ((I8, 127.5), (F8, 448.0)):
        _check(x, None, dtype, divisor, piece=piece, slots=slots, num_warps=warps)
        _check(x, gate, dtype, divisor, piece=piece, slots=slots, num_warps=warps)


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("floor_first", [True, False])
def test_the_floor_and_its_order(dtype, floor_first):
    x, _ = _rows(6, 64, seed=4)
    x[2] = 0  # (a zero row: the floor's scale)
    x[3] = x[3] * 1e-3
    _check(x, None, dtype, 448.0 if dtype == F8 else 127.5, floor=0.01, floor_first=floor_first)


def test_strided_rows_and_gates_cut_from_one_output():
    """A gate/up projection's output, halves of one [M, 2K] tensor: both read by its strides;
    fp16 and fp32 rows too."""
    for dtype in (BF16, torch.float16, torch.float32):
        h = torch.cat(_rows(7, 96, dtype, seed=5), 1)
        gate, up = h.chunk(2, dim=-1)
        _check(up, gate, I8, 127.5)


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("K", [64, 768, grouped_launch.QUANTIZE_BLOCK_K + 40])  # (one piece, 3, two reads)
def test_a_nan_or_an_infinity_makes_the_rows_scale_nan(dtype, value, K):
    """Its row's scale alone: in a row's first element, its last, and the last row's."""
    x, gate = _rows(7, K, seed=6)
    gate[1, 5] = gate[3, K - 1] = gate[6, 0] = value
    _, s = quantized_rows(x, dtype, Recipe(127.5, SCALE_EPS, None, gate), fake=False)
    assert s.isnan().tolist() == [False, True, False, True, False, False, True]


def test_rows_of_no_elements_are_refused():
    with pytest.raises(ValueError, match=r"quantized_rows: rows of no elements have no scale \(K = 0\)"):
        quantized_rows(torch.zeros(3, 0, device=DEVICE), I8, Recipe(127.5, SCALE_EPS), fake=False)
