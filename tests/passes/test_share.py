"""Sibling fused matmuls reading one copy of their activation's quantization
(fusepass/passes/share.py): at prefill sizes, where nothing groups them, q/k/v-style siblings
that each quantize the same input read the first copy, with the values each gets alone; and
the copies that are not the same value stay apart."""

import re

import torch

from fusepass.passes import PassConfig
from tests.passes.harness import run_pass
from tests.passes.test_group_pass import Siblings, x_of

F = torch.nn.functional
PREFILL = 32  # rows: above the group bound below, so no group takes one activation for them


def share(fn, *args, dynamic=None, **config):
    """``run_pass`` with siblings grouped up to M = 16 only (fp8 above PassConfig.fp8_max_m's
    64 rows would take cuBLAS: PREFILL stays below it)."""
    return run_pass(fn, *args, dynamic=dynamic, config=PassConfig(**{"group_max_m": 16, **config}))


def activations(r) -> list[str]:
    """The first operand of each fused scaled_mm call in the rewritten graph."""
    return re.findall(r"= fusepass\.scaled_mm\((\w+),", r.after)


def test_prefill_siblings_read_one_quantization():
    r = share(Siblings(), x_of(PREFILL))
    assert r.counts == {"int_mm_scaled": 3, "shared_activation": 2}
    calls = activations(r)
    assert len(calls) == 3 and len(set(calls)) == 1, r.after
    assert r.before.count("aten.amax(") == 3
    assert r.after.count("aten.amax(") == 1  # the other two copies went dead
    assert r.after.count("aten.round(") == 1


def test_turned_off_in_the_config():
    r = share(Siblings(), x_of(PREFILL), share_activations=False)
    assert r.counts == {"int_mm_scaled": 3}
    assert len(set(activations(r))) == 3 and r.after.count("aten.amax(") == 3


def test_same_values_as_each_linear_compiled_alone():
    for dtype in (torch.int8, torch.float8_e4m3fn):
        model, x = Siblings(dtype=dtype, bias=True), x_of(PREFILL)
        shared = share(model, x)
        assert len(set(activations(shared))) == 1
        for lin, out in zip(model.linears, shared.out, strict=True):
            alone = share(lin, x)
            assert len(activations(alone)) == 1
            torch.testing.assert_close(out, alone.out, rtol=0, atol=0)


def test_symbolic_m_shares_too():
    r = share(Siblings(), x_of(PREFILL), dynamic=True)
    assert len(set(activations(r))) == 1 and r.after.count("aten.amax(") == 1


def test_different_values_keep_their_own_quantization():
    model = Siblings()
    # another input, a scaled copy of the same input
    r = share(lambda x, y: [model.linears[0](x), model.linears[1](y), model.linears[2](x * 2)],
                 x_of(PREFILL), x_of(PREFILL, seed=2))
    assert len(set(activations(r))) == 3 and r.after.count("aten.amax(") == 3


def test_int8_and_fp8_quantizations_of_one_input_stay_apart():
    int8, fp8 = Siblings(widths=(16,)), Siblings(widths=(16,), dtype=torch.float8_e4m3fn)
    r = share(lambda x: [int8.linears[0](x), fp8.linears[0](x)], x_of(PREFILL))
    assert len(set(activations(r))) == 2 and r.after.count("aten.amax(") == 2


@torch.library.custom_op("fusepass_test::opaque_copy", mutates_args=())
def opaque_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@opaque_copy.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_op_results_are_not_one_value():
    """Two calls of a custom op on one input are two values, however alike (a custom op may
    hide state or randomness): not shared."""
    model = Siblings(widths=(16, 16))
    r = share(lambda x: [lin(opaque_copy(x)) for lin in model.linears], x_of(PREFILL))
    assert len(set(activations(r))) == 2, r.after
    assert r.after.count("fusepass_test.opaque_copy(") == 2


def test_siblings_quantizing_in_their_m1_launches_keep_their_rows():
    """Sharing runs after the in-launch quantization (quantized_in_gemv), which takes a row with one user:
    two ungrouped o_proj-style linears of one attention output at M = 1 each quantize it in
    their own launch, with no quantization kernel before them."""
    from fusepass.ops.dynamic import quantize_rows
    from tests.passes.test_quantize_in import EPS, H, D, _inputs

    def fn(q, k, v, w, sw, w2, sw2):
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, H * D)
        outs = []
        for ww, ss in ((w, sw), (w2, sw2)):
            qx, s = quantize_rows(x, torch.int8, 127.5, EPS)
            outs.append(((qx.float() * s) @ (ww.float() * ss).t()).to(torch.bfloat16))
        return outs

    q, k, v, w, sw = _inputs()
    w2, sw2 = _inputs(seed=1)[3:]
    r = share(fn, q, k, v, w, sw, w2, sw2, quantize_in_gemv=True, group_max_m=0)
    assert r.counts == {"dequant_mm": 2, "quantized_in_gemv": 2}, r.counts


def _int8_linear(divisor):
    """A hand-written int8 linear whose activation scale is amax / ``divisor``."""
    from fusepass.ops.dynamic import quantize_rows

    def linear(x, wq, ws):
        xq, xs = quantize_rows(x, torch.int8, divisor, 1e-8)
        return (torch._int_mm(xq, wq.t()).float() * xs * ws).to(x.dtype)
    return linear


def test_one_input_quantized_with_other_constants_stays_apart():
    lins = Siblings(widths=(16, 16)).linears
    r = share(lambda x: [_int8_linear(d)(x, lin.wq, lin.ws) for d, lin in zip((127.0, 127.5), lins)],
                 x_of(PREFILL))
    assert r.counts == {"int_mm_scaled": 2}  # (no shared_activation)
    assert len(set(activations(r))) == 2, r.after
