"""fusepass.scaled_mm_blockwise: the CPU reference against a float64 oracle, the layouts it
accepts, opcheck (schema, fake impl, dynamic shapes), and every bad input's message."""

import re

import pytest
import torch

import fusepass
from tests.support.blockwise_data import BLOCK, block_oracle, blocks, make_block_problem
from tests.support.helpers import assert_matches_oracle

F32, BF16 = torch.float32, torch.bfloat16
# Ragged K and N (last group 44 / 4 wide), K and N below one block, K a whole number of blocks.
SHAPES = [(0, 130, 200), (1, 17, 33), (7, 260, 300), (33, 132, 256)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("out_dtype", [BF16, torch.float16, F32], ids=str)
def test_reference_matches_float64(M, N, K, out_dtype):
    for i, (bias, m_major) in enumerate([(None, False), (out_dtype, True), (F32, False)]):
        p = make_block_problem(M, N, K, bias_dtype=bias, m_major=m_major, seed=i)
        out = fusepass.scaled_mm_blockwise(*p.args(out_dtype))
        assert out.is_contiguous()
        assert_matches_oracle(out, p, out_dtype, oracle=block_oracle)


def test_each_group_and_block_has_its_own_scale():
    """Ones times per-group powers of two: exact sums that any mixed-up group, block or ragged
    group length would change (K = 300: groups of 128, 128, 44; N = 260: blocks 128, 128, 4)."""
    M, N, K = 3, 260, 300
    a = torch.ones(M, K).to(torch.float8_e4m3fn)
    b = torch.ones(K, N).to(torch.float8_e4m3fn)
    sa = (2.0 ** torch.arange(blocks(K))).expand(M, -1).contiguous()  # 1, 2, 4 per K group
    sb = 16.0 ** torch.arange(blocks(N)).expand(blocks(K), -1).contiguous()  # 1, 16, 256 per N block
    out = fusepass.scaled_mm_blockwise(a, b, sa, sb, F32)
    per_row = 128 * 1 + 128 * 2 + 44 * 4
    expected = per_row * 16.0 ** (torch.arange(N) // BLOCK)
    assert torch.equal(out, expected.expand(M, N))


def test_k_zero_gives_bias():
    p = make_block_problem(3, 5, 0, bias_dtype=F32)
    assert p.scale_a.shape == (3, 0) and p.scale_b.shape == (0, 1)
    assert torch.equal(fusepass.scaled_mm_blockwise(*p.args(F32)), p.bias.expand(3, 5))


def test_dispatcher_and_wrapper_agree():
    p = make_block_problem(5, 140, 200, bias_dtype=BF16)
    assert torch.equal(torch.ops.fusepass.scaled_mm_blockwise(*p.args(BF16)), fusepass.scaled_mm_blockwise(*p.args(BF16)))


# --- opcheck --------------------------------------------------------------------------------

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# CPU fp8 has no arithmetic for test_schema's input comparison (as in test_opcheck.py).
UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _strided(p):
    p.a = torch.cat([p.a, p.a], dim=1)[:, ::2]  # stride (2K, 2)
    p.b = p.b.contiguous()  # row-major [K, N]
    return p


OPCHECK = {
    "M0": lambda d: make_block_problem(0, 24, 200, bias_dtype=F32, device=d),
    "decode": lambda d: make_block_problem(1, 130, 256, device=d),
    "ragged": lambda d: make_block_problem(33, 200, 300, bias_dtype=BF16, device=d),
    "m_major_strided": lambda d: _strided(make_block_problem(9, 48, 160, m_major=True, device=d)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPCHECK)
def test_opcheck(device, case):
    p = OPCHECK[case](device)
    torch.library.opcheck(torch.ops.fusepass.scaled_mm_blockwise.default, p.args(BF16), test_utils=UTILS)


def test_fake_impl_output():
    p = make_block_problem(33, 200, 300, bias_dtype=BF16, m_major=True)
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in p.args(torch.float16)]
    out = torch.ops.fusepass.scaled_mm_blockwise(*meta)
    assert (out.shape, out.stride(), out.dtype, out.device.type) == ((33, 200), (200, 1), torch.float16, "meta")


# --- bad input ------------------------------------------------------------------------------

M, N, K = 4, 200, 300  # 3 groups along K, 2 blocks along N


def _call(**override):
    p = make_block_problem(M, N, K, bias_dtype=F32)
    args = dict(a=p.a, b=p.b, scale_a=p.scale_a, scale_b=p.scale_b, out_dtype=BF16, bias=p.bias)
    args.update(override)
    return fusepass.scaled_mm_blockwise(**args)


f32 = lambda *s: torch.ones(s)  # noqa: E731
f8 = lambda *s: torch.zeros(s).to(torch.float8_e4m3fn)  # noqa: E731

BAD = [
    ("a int8", dict(a=torch.zeros(M, K, dtype=torch.int8)), TypeError,
     "`a` must have dtype float8_e4m3fn; got shape (4, 300), dtype torch.int8"),
    ("b e5m2", dict(b=torch.zeros(K, N).to(torch.float8_e5m2)), TypeError,
     "`b` must have dtype float8_e4m3fn; got shape (300, 200), dtype torch.float8_e5m2"),
    ("K mismatch", dict(b=f8(K + 1, N)), ValueError, "`b` must be [K, N] with K = 300"),
    ("out fp8", dict(out_dtype=torch.float8_e4m3fn), TypeError, "`out_dtype` must be one of bfloat16, float16, float32"),
    ("out str", dict(out_dtype="bfloat16"), TypeError, "got 'bfloat16' (str, not a torch.dtype)"),
    ("scale_a bf16", dict(scale_a=f32(M, 3).to(BF16)), TypeError, "`scale_a` must have dtype float32"),
    ("scale_a per-token", dict(scale_a=f32(M, 1)), ValueError,
     "`scale_a` must be [M, ceil(K/128)] = [4, 3], one scale per row of `a` and 128-wide group of K (K = 300); "
     "got shape (4, 1), dtype torch.float32, device cpu; one scale per row is per-token scaling: use fusepass.scaled_mm"),
    ("scale_a transposed", dict(scale_a=f32(3, M)), ValueError,
     "got shape (3, 4), dtype torch.float32, device cpu; that is [ceil(K/128), M]: pass its transpose `scale_a.t()`"),
    ("scale_a 60-wide groups", dict(scale_a=f32(M, 5)), ValueError, "5 groups over K = 300 would be 60-wide, not 128"),
    ("scale_a 1-D", dict(scale_a=f32(M * 3)), ValueError, "`scale_a` must be [M, ceil(K/128)] = [4, 3]"),
    ("scale_b fp64", dict(scale_b=f32(3, 2).double()), TypeError, "`scale_b` must have dtype float32"),
    ("scale_b weight layout", dict(scale_b=f32(2, 3)), ValueError,
     "`scale_b` must be [ceil(K/128), ceil(N/128)] = [3, 2], one scale per 128x128 block of `b` [K, N] = [300, 200]; "
     "got shape (2, 3), dtype torch.float32, device cpu; that is [ceil(N/128), ceil(K/128)], the layout of an [N, K] "
     "weight's scales: pass its transpose"),
    ("scale_b cuBLAS padded", dict(scale_b=f32(4, 2)), ValueError,
     "cuBLAS's layout pads the K blocks to a multiple of 4: pass `scale_b[:3]`"),
    ("scale_b per column", dict(scale_b=f32(3, N)), ValueError,
     "one scale per column of `b` (1x128 weight groups) is not supported: the op takes 128x128 blocks"),
    ("scale_b 60x100 blocks", dict(scale_b=f32(5, 2)), ValueError,
     "5x2 blocks over [K, N] = [300, 200] would be 60x100, not 128x128"),
    ("bias shape", dict(bias=f32(N + 1)), ValueError, "`bias` must be [N] with N = 200; got shape (201,)"),
    ("scale_b device", dict(scale_b=torch.ones(3, 2, device="meta")), ValueError,
     "all tensors must be on one device; `a` is on cpu but `scale_b` is on meta"),
]


@pytest.mark.parametrize("name,override,exc,message", BAD, ids=[c[0] for c in BAD])
def test_rejects(name, override, exc, message):
    with pytest.raises(exc, match="^fusepass.scaled_mm_blockwise: .*" + re.escape(message)):
        _call(**override)


# The dispatcher itself refuses an out_dtype that is not a dtype, before the fake impl.
FAKE_BAD = [c for c in BAD[:10] if isinstance(c[1].get("out_dtype", BF16), torch.dtype)]


@pytest.mark.parametrize("name,override,exc,message", FAKE_BAD, ids=[c[0] for c in FAKE_BAD])
def test_fake_impl_rejects_too(name, override, exc, message):
    """Under torch.compile the fake impl sees the inputs first: the same errors at trace time."""
    p = make_block_problem(M, N, K, bias_dtype=F32)
    args = dict(a=p.a, b=p.b, scale_a=p.scale_a, scale_b=p.scale_b, out_dtype=BF16, bias=p.bias)
    args.update(override)
    fake = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(exc, match=re.escape(message.replace("device cpu", "device meta"))):
        torch.ops.fusepass.scaled_mm_blockwise(**fake)


# --- fusepass.scaled_mm_blockwise_dynamic ----------------------------------------------------


def _dynamic_args(M=3, N=200, K=256, device="cpu", bias=True):
    p = make_block_problem(M, N, K, bias_dtype=BF16 if bias else None, device=device, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(BF16).to(device)
    return x, p.b, p.scale_b, BF16, p.bias, 1e-6


@pytest.mark.parametrize("M", [0, 1, 3])
def test_dynamic_is_its_quantization_then_the_op(M):
    from fusepass.ops.blockwise import quantize_groups

    x, b, scale_b, out_dtype, bias, floor = _dynamic_args(M)
    q, scale_a = quantize_groups(x, floor)
    expected = fusepass.scaled_mm_blockwise(q, b, scale_a, scale_b, out_dtype, bias)
    assert torch.equal(fusepass.scaled_mm_blockwise_dynamic(x, b, scale_b, out_dtype, bias, floor), expected)
    assert torch.equal(torch.ops.fusepass.scaled_mm_blockwise_dynamic(x, b, scale_b, out_dtype, bias, floor), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_opcheck(device):
    torch.library.opcheck(torch.ops.fusepass.scaled_mm_blockwise_dynamic.default, _dynamic_args(1, device=device),
                          test_utils=UTILS)


@pytest.mark.parametrize("change,exc,message", [
    (lambda a: (a[0][:, :200], a[1][:200], a[2][:2]) + a[3:], ValueError, "K must be whole 128-wide groups .*K = 200"),
    (lambda a: a[:5] + (0.0,), ValueError, r"`floor` must be a finite number > 0 .*got 0.0"),
    (lambda a: a[:5] + (float("inf"),), ValueError, r"`floor` must be a finite number > 0 .*got inf"),
    (lambda a: (a[0].to(torch.int8),) + a[1:], TypeError, "`x`"),
    (lambda a: a[:2] + (a[2][:1],) + a[3:], ValueError, "`scale_b` must be"),
], ids=["ragged-k", "floor-0", "floor-inf", "int8-x", "scale_b-one-k-block"])
def test_dynamic_rejects(change, exc, message):
    args = change(_dynamic_args())
    for call in (fusepass.scaled_mm_blockwise_dynamic, torch.ops.fusepass.scaled_mm_blockwise_dynamic):
        with pytest.raises(exc, match=message):
            call(*args)


def test_quantize_groups_is_the_prepared_linears_recipe():
    """A prepared fp8-block linear quantizes its input with the op's group recipe and its own
    floor: the same values and scales."""
    from fusepass.integrations.linear import Act, quantize_input
    from fusepass.ops.blockwise import quantize_groups

    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(0)).to(BF16)
    x[1, :128] = 0.0
    act = Act("fp8-block")
    q, s, _ = quantize_input(x, act)
    q2, s2 = quantize_groups(x, act.floor)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
