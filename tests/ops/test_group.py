"""fusepass.scaled_mm_group: each member equals fusepass.scaled_mm on the same operands (CPU
reference; on a GPU the grouped launch and the per-member fallback), opcheck, and every bad
input's message."""

import pytest
import torch

import fusepass
from tests.support.helpers import make_problem

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BF16 = torch.bfloat16


def _group(M, Ns, K, device="cpu", dtype=torch.int8, **kw):
    ps = [make_problem(M, N, K, dtype, device=device, seed=i, **kw) for i, N in enumerate(Ns)]
    return ps[0].a, [p.b for p in ps], ps[0].scale_a, [p.scale_b for p in ps], [p.bias for p in ps]


def _as_members(a, bs, sa, sbs, out_dtype, biases):
    return [fusepass.scaled_mm(a, b, sa, sb, out_dtype, bias) for b, sb, bias in zip(bs, sbs, biases)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("bias", [None, torch.float32], ids=["no-bias", "bias"])
def test_members_equal_scaled_mm(device, dtype, bias):
    a, bs, sa, sbs, biases = _group(3, [24, 8, 8], 40, device, dtype, bias_dtype=bias)
    outs = fusepass.scaled_mm_group(a, bs, sa, sbs, BF16, biases)
    assert [o.shape for o in outs] == [(3, 24), (3, 8), (3, 8)]
    for out, want in zip(outs, _as_members(a, bs, sa, sbs, BF16, biases)):
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_layouts_and_variants_run_member_by_member(device):
    """Members one launch cannot take (another weight layout, per-tensor next to per-channel
    scales, a bias next to none) still compute each member's scaled_mm."""
    a, bs, sa, sbs, biases = _group(5, [16, 32], 64, device, bias_dtype=torch.float32)
    bs[1] = bs[1].contiguous()  # [K, N] row-major where bs[0] is w.t()
    sbs[0] = sbs[0].reshape(-1)[:1]  # per-tensor
    biases[1] = None
    outs = torch.ops.fusepass.scaled_mm_group(a, bs, sa, sbs, torch.float32, biases)
    for out, want in zip(outs, _as_members(a, bs, sa, sbs, torch.float32, biases)):
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_bias_defaults_to_none_and_dispatcher_agrees():
    a, bs, sa, sbs, _ = _group(2, [8, 16], 32)
    wrapper = fusepass.scaled_mm_group(a, bs, sa, sbs, BF16)
    op = torch.ops.fusepass.scaled_mm_group(a, bs, sa, sbs, BF16, [None, None])
    assert all(torch.equal(w, o) for w, o in zip(wrapper, op))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", [0, 1, 9])
def test_opcheck(device, M):
    a, bs, sa, sbs, biases = _group(M, [24, 16, 8], 40, device, bias_dtype=BF16)
    torch.library.opcheck(torch.ops.fusepass.scaled_mm_group.default, (a, bs, sa, sbs, BF16, biases))


@pytest.mark.parametrize("change, error, message", [
    (lambda g: g.update(b=g["b"][:1], scale_b=g["scale_b"][:1], bias=[None]), ValueError,
     "`b` must hold 2 to 4 weights; got 1 (one weight: fusepass.scaled_mm)"),
    (lambda g: g.update(b=g["b"] * 3, scale_b=g["scale_b"] * 3, bias=[None] * 6), ValueError,
     "`b` must hold 2 to 4 weights; got 6"),
    (lambda g: g.update(scale_b=g["scale_b"][:1]), ValueError,
     "`scale_b` and `bias` need one entry per weight (2); got 1 and 2"),
    (lambda g: g.update(b=g["b"][0]), TypeError, "`b` must be a list (one entry per weight); got Tensor"),
    (lambda g: g["b"].__setitem__(1, g["b"][1][:5]), ValueError,
     "fusepass.scaled_mm_group (weight 1): `b` must be [K, N] with K = 32"),
    (lambda g: g["scale_b"].__setitem__(0, torch.ones(3)), ValueError,
     "fusepass.scaled_mm_group (weight 0): `scale_b` must hold one value (per-tensor) or one per column"),
    (lambda g: g["b"].__setitem__(1, g["b"][1].float()), TypeError,
     "fusepass.scaled_mm_group (weight 1): `b` must have dtype int8, float8_e4m3fn"),
], ids=["one", "six", "scales", "not-a-list", "k", "scale-shape", "dtype"])
def test_bad_input(change, error, message):
    a, bs, sa, sbs, biases = _group(2, [8, 16], 32)
    g = dict(b=list(bs), scale_b=list(sbs), bias=list(biases))
    change(g)
    with pytest.raises(error) as e:
        fusepass.scaled_mm_group(a, g["b"], sa, g["scale_b"], BF16, g["bias"])
    assert message in str(e.value)


def test_out_dtype_as_string_is_a_type_error():
    a, bs, sa, sbs, _ = _group(2, [8, 16], 32)
    with pytest.raises(TypeError, match="fusepass.scaled_mm_group: `out_dtype` must be one of"):
        fusepass.scaled_mm_group(a, bs, sa, sbs, "bfloat16")
