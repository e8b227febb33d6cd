"""fusepass.scaled_mm_dynamic: the quantization of prepare's modules then scaled_mm, on the CPU
reference, the M = 1 kernel quantizing its own row (interpreter / GPU: its rounding and clamp
exactly, its scale to an fp32 rounding), opcheck, bad inputs."""

import pytest
import torch

import fusepass
from fusepass.integrations.linear import SCALE_EPS, Act
from fusepass.integrations.linear import quantize_input as module_rows
from fusepass.kernels import launch
from fusepass.ops.dynamic import quantize_rows, scaled_mm_dynamic
from tests.support.helpers import DIVISOR, quantized_row_bound, quantizing_launch_and_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I8, F8, BF16 = torch.int8, torch.float8_e4m3fn, torch.bfloat16


def _problem(N, K, dtype, x_dtype=BF16, scale=3.0, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, K, generator=g) * scale).to(x_dtype)
    w = (torch.randn(N, K, generator=g) * 40).clamp(-127, 127).to(dtype) if dtype == I8 else \
        torch.randn(N, K, generator=g).to(dtype)
    sb, bias = torch.rand(N, generator=g) * 0.01, torch.randn(N, generator=g).to(BF16)
    return tuple(t.to(device) for t in (x, w.t(), sb, bias))


@pytest.mark.parametrize("kind,dtype", [("int8", I8), ("fp8", F8)])
def test_the_quantization_is_a_prepared_modules(kind, dtype):
    x = torch.randn(3, 300, dtype=BF16) * torch.tensor([[1e-9], [1.0], [50.0]]).to(BF16)
    q, s = quantize_rows(x, dtype, DIVISOR[dtype], SCALE_EPS)
    mq, ms, _ = module_rows(x, Act(kind, DIVISOR[dtype]) if kind == "int8" else Act(kind))
    assert torch.equal(q.view(torch.int8), mq.view(torch.int8)) and torch.equal(s, ms)


def test_the_m1_kernel_rounds_half_to_even_and_clamps_as_torch():
    """A row whose scale is exactly 1 (amax 127.5): ties both ways, -0.0, both clamp ends."""
    values = [127.5, -127.5, 0.5, -0.5, 1.5, 2.5, -2.5, 3.5, -3.5, -0.0, 126.49, -1.25]
    x = torch.tensor(values + [0.0] * 21, dtype=BF16, device=DEVICE)[None]  # K = 33
    _, b, sb, bias = _problem(40, 33, I8)
    q = torch.tensor([127, -128, 0, 0, 2, 2, -2, 4, -4, 0, 126, -1] + [0] * 21, dtype=I8, device=DEVICE)[None]
    assert torch.equal(quantize_rows(x, I8, 127.5, SCALE_EPS)[0], q)
    out, ref, _, s = quantizing_launch_and_reference(x, b, sb, bias)
    assert s.item() == 1.0 and torch.equal(out, ref)


def test_the_m1_kernel_rounds_to_e4m3_as_torch():
    """fp8: a row whose scale is exactly 1 (amax 448): midpoints of e4m3's grid both ways
    (normal, subnormal, into the next binade), the smallest normal, -0.0 (a zero: no sum can
    tell its sign, nor this check)."""
    values = [448.0, -448.0, 1.0625, 1.1875, -1.1875, 248.0, 2.0**-10, 3 * 2.0**-10, 15 * 2.0**-10, 2.0**-6,
              126.4448, -0.0, 0.3]
    x = torch.tensor(values + [0.0] * 20, dtype=torch.float32, device=DEVICE)[None]  # K = 33
    _, b, sb, bias = _problem(40, 33, F8)
    q, s = quantize_rows(x, F8, 448.0, SCALE_EPS)
    assert s.item() == 1.0 and q.float().flatten()[:11].tolist() == [448.0, -448.0, 1.0, 1.25, -1.25, 256.0, 0.0,
                                                                        2.0**-8, 2.0**-6, 2.0**-6, 128.0]
    out, ref, _, _ = quantizing_launch_and_reference(x, b, sb, bias)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("N,K", [(17, 33), (100, 1000), (64, 2048), (24, 4096 + 512)])
@pytest.mark.parametrize("x_dtype,scale", [(BF16, 3.0), (torch.float32, 3.0), (BF16, 1e-9)])
@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
def test_the_m1_kernel_quantizing_its_row_is_the_quantization_then_the_kernel(N, K, x_dtype, scale, dtype):
    """Its scale's division is IEEE fp32's, the reference's the device's own: a value may land
    one step apart where ``x / s`` sits at a tie of the two roundings (policy: a step's share)."""
    x, b, sb, bias = _problem(N, K, dtype, x_dtype, scale)
    out, ref, _, s = quantizing_launch_and_reference(x, b, sb, bias)
    assert ((out - ref).abs().flatten() <= quantized_row_bound(x, s, b, sb, ref, bias)).all()


def _gated_row(K, x_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, K, generator=g) * 3).to(x_dtype).to(DEVICE) for _ in range(2))  # gate, up


# (2048: whole blocks, dp4a where compiled; then whole blocks and a part: two on a GPU, one in the
# interpreter, whose K x K identity weight at 4608 took a CI core 2 minutes over the six cases)
LONG_K = 4096 + 512 if DEVICE == "cuda" else 2048 + 512


@pytest.mark.parametrize("K", [33, 1000, 2048, LONG_K])
@pytest.mark.parametrize("x_dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
def test_the_m1_kernel_gates_its_row_as_eager_rounds(K, x_dtype, dtype):
    """GATED: the row ``silu(gate) * up``, each op rounded to the row's dtype, then quantized:
    read back through an identity weight (out = scale * q), as eager's ``F.silu(gate) * up``
    quantized. In the interpreter exactly; on a GPU Triton's ``exp`` is not CUDA's, so a value
    may round to a neighbour in the row's dtype: at most one step, at few elements."""
    gate, up = _gated_row(K, x_dtype)
    eye = torch.eye(K, device=DEVICE).to(dtype)  # (b = w.t() of w = I: columns contiguous along K)
    out = launch.launch_gemv_quantized(up, eye.t(), torch.ones(K, device=DEVICE), torch.float32, None,
                                       DIVISOR[dtype], SCALE_EPS, gate=gate)
    q, s = quantize_rows(torch.nn.functional.silu(gate) * up, dtype, DIVISOR[dtype], SCALE_EPS)
    ref = (q.float() * s).flatten()
    if DEVICE == "cpu":
        assert torch.equal(out.flatten(), ref)
        # (int8's finer steps tell the roundings between the ops apart at these rows; at K = 2048
        # the fp16 row's do not, which the other widths show)
        unrounded = gate.float() / (1 + torch.exp(-gate.float())) * up.float()
        assert K < 100 or (K == 2048 and x_dtype == torch.float16) or x_dtype == torch.float32 or dtype == F8 or \
            not torch.equal(quantize_rows(unrounded, dtype, DIVISOR[dtype], SCALE_EPS)[0], q)
    else:  # (a step: int8's, or e4m3's at that value, 1/8 of it at most; the scale an fp32 rounding apart)
        apart = (out.flatten() - ref).abs()
        step = s.flatten() if dtype == I8 else ref.abs() / 8 + s.flatten() * 2.0**-9
        assert (apart <= 1.01 * step).all() and int((apart > step / 2).sum()) <= max(2, K // 100)


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("where,value", [("x", float("nan")), ("x", float("inf")), ("x", -float("inf")),
                                         ("gate", float("nan")), ("gate", float("inf")), ("overflow", 3e38)])
def test_a_nan_or_an_infinity_in_the_row_gives_nan(dtype, where, value):
    """As eager's fp8 (a NaN, or ``inf / inf`` under an infinite scale, cast to e4m3 is NaN);
    ``overflow``: the gated product of two finite bf16 rows is infinite."""
    x, b, sb, bias = _problem(64, 100, dtype)
    gate = None if where == "x" else torch.randn_like(x)
    (x if where == "x" else gate if where == "gate" else x)[0, 37] = value
    if where == "overflow":
        gate[0, 37] = value
    out = launch.launch_gemv_quantized(x, b, sb, torch.float32, bias, DIVISOR[dtype], SCALE_EPS, gate=gate)
    assert out.isnan().all()
    if dtype == F8:
        h = x if gate is None else torch.nn.functional.silu(gate) * x
        q, s = quantize_rows(h, F8, 448.0, SCALE_EPS)
        assert (q.float() * s).isnan().any()  # (eager's row: NaN where the kernel says so)


def test_gemv_quantizes_a_gate_only_of_the_rows_dtype_shape_and_stride():
    x, b, _, _ = _problem(4096, 512, I8, device="cpu")
    wide = torch.randn(1, 1024, dtype=BF16)
    for gate, takes in ((None, True), (torch.randn_like(x), True), (wide[:, 512:], True), (wide[:, ::2], False),
                        (torch.randn_like(x, dtype=torch.float16), False), (torch.randn(1, 256, dtype=BF16), False)):
        assert launch.gemv_quantizes(x, b, gate) == takes, gate
    assert not launch.gemv_quantizes(x.float(), b.float(), None)  # (a float b: no quantized row)


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
def test_the_m1_kernel_gates_rows_cut_from_one_buffer(dtype):
    """gate/up's joined output: the gate and the row at two offsets of one buffer, unit stride
    (a model's), or interleaved (stride 2); as the same rows made contiguous."""
    K = 1000
    _, b, sb, bias = _problem(48, K, dtype)
    buf = torch.randn(1, 2 * K, device=DEVICE).to(BF16) * 3
    want = None
    for gate, up in ((buf[:, :K], buf[:, K:]), (buf[:, ::2], buf[:, 1::2])):
        out = launch.launch_gemv_quantized(up, b, sb, torch.float32, bias, DIVISOR[dtype], SCALE_EPS, gate=gate)
        ref = launch.launch_gemv_quantized(up.contiguous(), b, sb, torch.float32, bias, DIVISOR[dtype], SCALE_EPS,
                                           gate=gate.contiguous())
        assert torch.equal(out, ref)
        want = out if want is None else want
    assert not torch.equal(want, out)  # (two different pairs of rows)


def test_the_op_is_the_quantization_then_scaled_mm():
    x, b, sb, bias = _problem(4096, 512, I8, device="cpu")
    q, s = quantize_rows(x, I8, 127.5, SCALE_EPS)
    want = fusepass.scaled_mm(q, b, s, sb, BF16, bias)
    assert torch.equal(scaled_mm_dynamic(x, b, sb, BF16, bias, 127.5, SCALE_EPS), want)
    assert torch.equal(torch.ops.fusepass.scaled_mm_dynamic(x, b, sb, BF16, bias, 127.5, SCALE_EPS), want)
    x2 = torch.cat([x, -x])  # (M = 2: the same on each row)
    assert torch.equal(scaled_mm_dynamic(x2, b, sb, BF16, bias)[0], want[0])
    empty = torch.empty(3, 0, dtype=BF16)  # (K = 0: an empty sum, the bias alone, as scaled_mm)
    assert torch.equal(scaled_mm_dynamic(empty, b[:0], sb, BF16, bias), bias.expand(3, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
def test_the_op_takes_the_quantizing_kernel_at_one_row_on_cuda(monkeypatch, dtype):
    x, b, sb, bias = _problem(4096, 4096, dtype)
    taken = []
    real = launch.launch_gemv_quantized
    monkeypatch.setattr("fusepass.ops.dynamic.launch_gemv_quantized", lambda *a: taken.append(1) or real(*a))
    q, s = quantize_rows(x, dtype, DIVISOR[dtype], SCALE_EPS)
    out = scaled_mm_dynamic(x, b, sb, BF16, bias, DIVISOR[dtype], SCALE_EPS)
    want = fusepass.scaled_mm(q, b, s, sb, BF16, bias)
    assert taken == [1]
    # (and each output rounded to bf16: up to a bf16 rounding each)
    bound = quantized_row_bound(x, s, b, sb, want, bias) + 2**-7 * want.float().abs().flatten()
    assert ((out.float() - want.float()).abs().flatten() <= bound).all()


@pytest.mark.parametrize("dtype", [I8, F8], ids=["int8", "fp8"])
@pytest.mark.parametrize("floor_first", [True, False])
def test_floor_first_picks_the_scales_order_in_the_kernel_as_in_the_recipe(dtype, floor_first):
    """A hand-written int8 form floors the amax before dividing (fp8's order); rows small
    enough that the floor sets the scale tell the orders apart (read back through an identity
    weight: scale * q)."""
    K, divisor, floor = 64, DIVISOR[dtype], 1e-4
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(3)) * 1e-3).to(DEVICE)
    eye = torch.eye(K, device=DEVICE).to(dtype)
    out = launch.launch_gemv_quantized(x, eye.t(), torch.ones(K, device=DEVICE), torch.float32, None, divisor, floor,
                                       floor_first=floor_first)
    q, s = quantize_rows(x, dtype, divisor, floor, floor_first)
    other = quantize_rows(x, dtype, divisor, floor, not floor_first)[1]
    assert s.item() != other.item()
    # The kernel divides correctly rounded, as the CPU's eager does; CUDA's eager multiplies by
    # the reciprocal, an fp32 rounding apart (quantized_row_bound): the CPU's recipe is exact.
    cq, cs = quantize_rows(x.cpu(), dtype, divisor, floor, floor_first)
    assert torch.equal(out.flatten().cpu(), (cq.float() * cs).flatten())
    # (and through the op, which takes its ATen ops at this N)
    op = torch.ops.fusepass.scaled_mm_dynamic(x, eye.t(), torch.ones(K, device=DEVICE), torch.float32, None, divisor,
                                              floor, None, floor_first)
    assert torch.equal(op.flatten(), (q.float() * s).flatten())
    default = quantize_rows(x, dtype, divisor, floor)[1]
    assert torch.equal(default, s) == (floor_first == (dtype == F8))


def test_the_op_with_a_gate_is_silu_mul_then_the_quantization():
    x, b, sb, bias = _problem(4096, 512, I8, device="cpu")
    gate = torch.randn_like(x)
    q, s = quantize_rows(torch.nn.functional.silu(gate) * x, I8, 127.5, SCALE_EPS)
    want = fusepass.scaled_mm(q, b, s, sb, BF16, bias)
    assert torch.equal(scaled_mm_dynamic(x, b, sb, BF16, bias, 127.5, SCALE_EPS, gate), want)
    assert torch.equal(torch.ops.fusepass.scaled_mm_dynamic(x, b, sb, BF16, bias, 127.5, SCALE_EPS, gate), want)


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True], ids=["rows", "gate-strided"])
def test_the_op_takes_the_gating_kernel_where_both_rows_share_a_stride(monkeypatch, strided):
    """A gate read with ``x``'s stride runs in the M = 1 kernel; one of another stride takes
    the ATen ops (SiLU-mul, the quantization), then ``scaled_mm``."""
    x, b, sb, bias = _problem(4096, 4096, I8)
    gate = torch.randn(1, 2 * 4096, device=DEVICE).to(BF16)[:, ::2] if strided else torch.randn_like(x)
    taken = []
    real = launch.launch_gemv_quantized
    monkeypatch.setattr("fusepass.ops.dynamic.launch_gemv_quantized", lambda *a: taken.append(1) or real(*a))
    q, s = quantize_rows(torch.nn.functional.silu(gate) * x, I8, 127.5, SCALE_EPS)
    want = fusepass.scaled_mm(q, b, s, sb, BF16, bias)
    out = scaled_mm_dynamic(x, b, sb, BF16, bias, 127.5, SCALE_EPS, gate)
    assert taken == ([] if strided else [1])
    if strided:
        assert torch.equal(out, want)
    else:  # (a step at few elements, as the kernel test, and each output's bf16 rounding)
        steps = s.flatten() * sb.abs() * b.abs().float().max(0).values * 2
        assert ((out.float() - want.float()).abs().flatten() <= steps + 2**-7 * want.float().abs().flatten()).all()


def test_opcheck():
    x, b, sb, bias = _problem(48, 160, I8, device="cpu")
    for args in ((x, b, sb, BF16, bias, 127.5, SCALE_EPS), (x.repeat(3, 1), b, sb.view(1, -1), torch.float32, None, 127.0, 0.0),
                 (x, b, sb, BF16, bias, 127.5, SCALE_EPS, torch.randn_like(x)),
                 (x, b, sb, BF16, bias, 127.0, 1e-8, None, True)):
        torch.library.opcheck(torch.ops.fusepass.scaled_mm_dynamic.default, args)


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.zeros(1, 160, dtype=I8)), TypeError, "`x` must have dtype bfloat16, float16, float32"),
    (dict(x=torch.zeros(160, dtype=BF16)), ValueError, "`x` must be [M, K] and `b` [K, N]"),
    (dict(b=torch.zeros(100, 48, dtype=I8)), ValueError, "`x` must be [M, K] and `b` [K, N]"),
    (dict(b=torch.zeros(160, 48, dtype=BF16)), TypeError, "`b` must have dtype int8, float8_e4m3fn"),
    (dict(sb=torch.zeros(47)), ValueError, "scale_b"),
    (dict(divisor=0.0), ValueError, "`divisor` must be > 0 and `floor` >= 0; got 0.0"),
    (dict(floor=-1.0), ValueError, "`floor` >= 0; got 127.5, -1.0"),
    (dict(divisor=True), ValueError, "`divisor` must be > 0 and `floor` >= 0; got True"),
    (dict(out_dtype=torch.int8), TypeError, "`out_dtype` must be one of bfloat16, float16, float32"),
    (dict(gate=torch.zeros(1, 160, dtype=I8)), TypeError, "`gate` must have dtype bfloat16, float16, float32"),
    (dict(gate=torch.zeros(1, 160)), ValueError, "`gate` must have `x`'s dtype and shape; got gate shape (1, 160), dtype torch.float32"),
    (dict(gate=torch.zeros(2, 160, dtype=BF16)), ValueError, "`gate` must have `x`'s dtype and shape"),
    (dict(floor_first=1), ValueError, "`floor_first` must be None, True or False; got 1"),
])
def test_bad_inputs_are_refused_by_name(change, error, message):
    x, b, sb, bias = _problem(48, 160, I8, device="cpu")
    args = dict(x=x, b=b, sb=sb, out_dtype=BF16, bias=bias, divisor=127.5, floor=SCALE_EPS, gate=None,
                floor_first=None) | change
    with pytest.raises(error, match=None) as e:
        scaled_mm_dynamic(*args.values())
    assert message in str(e.value), str(e.value)
