"""The longest valid prefix: where a later step cannot be taken, the matmul still fuses up
to it, and ``explain`` says where the epilogue ended and why, in user terms. Also the
zero-point forms of issue 11: torchao's asymmetric activations (the correction after the
scaling) and int64 zero-point terms."""

import re

import expecttest
import torch

import fusepass
from tests.passes.data import K, M, N, bias, i8, scale
from tests.passes.harness import assert_policy, run_pass

F = torch.nn.functional


def acc64(a, b):
    return a.double() @ b.double()


a, w = i8(M, K), i8(N, K, seed=1)
sa, sb, bs = scale(M, 1), scale(1, N, seed=2), bias()


class TestPrefix(expecttest.TestCase):
    def fused_in_part(self, fn, args, pattern="int_mm_scaled"):
        r = run_pass(fn, *args)
        self.assertEqual(r.counts, {pattern: 1})
        (d,) = r.decisions
        self.assertTrue(d.fused and d.partial, d)
        torch.testing.assert_close(r.out, fn(*args), rtol=1e-5, atol=1e-5)
        return r, d

    def test_shared_mid_chain_value_fuses_up_to_it(self):
        def f(a, b, sa, sb):
            y = torch._int_mm(a, b).float() * sa
            return y * sb, y.amax()

        r, d = self.fused_in_part(f, (a, w.t(), sa, sb))
        self.assertIn("its value is also used elsewhere, so the step at test_prefix.py:", d.reason)
        self.assertIn("return y * sb, y.amax()", d.reason)
        self.assertExpectedInline(r.after, """\
reshape_default: f32[24] = aten.reshape(sa, [-1])
full_default: f32[] = aten.full([], 1.0, dtype=f32, device=device(type='cpu'))
scaled_mm_default: f32[24, 40] = fusepass.scaled_mm(a, b, reshape_default, full_default, f32, None)
mul_1: f32[24, 40] = aten.mul.Tensor(scaled_mm_default, sb)
amax: f32[] = aten.amax(scaled_mm_default)
return [mul_1, amax]""")

    def test_multiply_after_the_bias_stays_outside(self):
        def f(a, b, sa, sb, bias):
            return (torch._int_mm(a, b).float() * sa + bias) * sb

        r, d = self.fused_in_part(f, (a, w.t(), sa, sb.reshape(N), bs))
        self.assertIn("a multiply follows the bias add", d.reason)
        self.assertIn("(at test_prefix.py:", d.reason)
        self.assertIn("mul_1: f32[24, 40] = aten.mul.Tensor(scaled_mm_default, sb)", r.after)

    def test_fused_in_part_says_what_fused_and_what_the_rest_costs(self):
        def f(a, b, sa, sb, bias):
            return (torch._int_mm(a, b).float() * sa + bias) * sb

        report = fusepass.explain(f, a, w.t(), sa, sb.reshape(N), bs)
        (d,) = report.decisions
        self.assertEqual(d.kept, "the matmul with a per-token scale, the bias")
        # the multiply by sb reads the f32[24, 40] output again: 24 * 40 * 4 bytes
        self.assertEqual(d.cost, "the steps after it run outside the GEMM: at most one more kernel, reading its "
                                 "f32[24, 40] output again (3.8 KiB a call)".replace("f32", "float32"))
        self.assertIn(f"the matmul with a per-token scale, the bias; the epilogue ends early: {d.reason}\n"
                      f"      cost: {d.cost}", str(report))

    def test_fused_in_part_at_a_symbolic_m_costs_per_row(self):
        def f(a, b, sa, sb, bias):
            return (torch._int_mm(a, b).float() * sa + bias) * sb

        report = fusepass.explain(f, i8(48, K), w.t(), scale(48, 1), sb.reshape(N), bs, dynamic=True)
        (d,) = report.decisions
        self.assertTrue(d.partial, report)
        self.assertTrue(d.cost.endswith(f"output again ({N * 4} bytes a row)"), d.cost)

    def test_cast_of_a_shared_value_is_no_lost_step(self):
        """A shared value that is only cast or viewed elsewhere: fused whole."""

        def f(a, b, sa, sb):
            y = (torch._int_mm(a, b).float() * sa * sb).to(torch.bfloat16)
            return y, y.float().sum()

        r = run_pass(f, a, w.t(), sa, sb)
        (d,) = r.decisions
        self.assertTrue(d.fused and not d.partial, d)

    def test_upcast_for_an_activation_stays_in_the_graph(self):
        """``silu(y.to(bf16))`` computes in fp32: the op writes the bf16 the graph rounds to
        (not fp32, twice the bytes) and the upcast fuses into SiLU's kernel."""

        def f(a, b, sa, sb):
            y = (torch._int_mm(a, b).float() * sa * sb).to(torch.bfloat16)
            return F.silu(y.float())

        r = run_pass(f, a, w.t(), sa, sb)
        (d,) = r.decisions
        self.assertTrue(d.fused and not d.partial, d)
        self.assertIn("bf16[24, 40] = fusepass.scaled_mm(", r.after)
        self.assertIn("prims.convert_element_type(scaled_mm_default, f32)", r.after)
        torch.testing.assert_close(r.out, f(a, w.t(), sa, sb), rtol=1e-5, atol=1e-5)

    def test_upcast_before_a_step_joins_the_epilogue(self):
        def f(a, b, sa, sb):
            return (torch._int_mm(a, b).float() * sa).to(torch.bfloat16).float() * sb

        r = run_pass(f, a, w.t(), sa, sb)
        (d,) = r.decisions
        self.assertTrue(d.fused and not d.partial, d)
        self.assertIn("f32[24, 40] = fusepass.scaled_mm(a, b, reshape_default, reshape_default_1, f32, None)", r.after)

    def test_upcast_through_a_view_for_an_activation_stays_in_the_graph(self):
        def f(a, b, sa, sb):
            y = (torch._int_mm(a, b).float() * sa * sb).to(torch.bfloat16)
            return F.silu(y.float().reshape(2, M // 2, N))

        r = run_pass(f, a, w.t(), sa, sb)
        self.assertIn("bf16[24, 40] = fusepass.scaled_mm(", r.after)
        torch.testing.assert_close(r.out, f(a, w.t(), sa, sb), rtol=1e-5, atol=1e-5)

    def test_a_refused_step_after_an_upcast_is_explained(self):
        """The upcast joins the chain, and the walk says why it ended at the second bias."""

        def f(a, b, sa, sb, bias):
            return (torch._int_mm(a, b).float() * sa * sb + bias).to(torch.bfloat16).float() + bias

        r = run_pass(f, a, w.t(), sa, sb, bs)
        (d,) = r.decisions
        self.assertTrue(d.fused and d.partial, d)
        self.assertIn("a second [N] vector is added", d.reason)
        self.assertIn("f32[24, 40] = fusepass.scaled_mm(", r.after)  # (without the bf16 rounding)
        torch.testing.assert_close(r.out, f(a, w.t(), sa, sb, bs), rtol=1e-2, atol=1e-2)

    def test_upcast_the_graph_returns_joins_the_epilogue(self):
        """Left in the graph it would be a kernel of its own: the op writes fp32 directly."""

        def f(a, b, sa, sb):
            return (torch._int_mm(a, b).float() * sa * sb).to(torch.bfloat16).float()

        r = run_pass(f, a, w.t(), sa, sb)
        self.assertIn("f32[24, 40] = fusepass.scaled_mm(", r.after)
        self.assertNotIn("convert_element_type", r.after)

    def test_torchao_asymmetric_zero_point_after_scaling(self):
        """torchao's Int8DynamicActivationInt8WeightConfig(act_mapping_type=ASYMMETRIC):
        acc * sa - (z * sa) * colsum, then * sw: one scaled_mm_azp, the correction exact."""

        def f(a, b, sa, sw, z, w_q, bias):
            y = torch._int_mm(a, b).float() * sa
            colsum = w_q.sum(-1)  # int64
            y = y - (z.float() * sa) * colsum.float()
            return (y * sw).reshape(2, M // 2, N) + bias

        z = torch.randint(-128, 128, (M, 1), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
        args = (a, w.t(), sa, sb.reshape(N), z, w, bs)
        ref = ((acc64(a, w.t()) - z.double() * w.double().sum(1)) * sa.double() * sb.double() + bs.double())
        r = run_pass(f, *args)
        self.assertEqual(r.counts, {"int_mm_azp_per_token": 1})
        self.assertFalse(r.decisions[0].partial, r.decisions[0])
        assert_policy(r.out, f(*args), ref.reshape(2, M // 2, N))
        self.assertExpectedInline(r.after, """\
sum_1: i64[40] = aten.sum.dim_IntList(w_q, [-1])
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: i8[24] = aten.reshape(z, [-1])
convert_element_type_default: i32[24] = prims.convert_element_type(reshape_default_1, i32)
scaled_mm_azp_default: f32[24, 40] = fusepass.scaled_mm_azp(a, b, reshape_default, sw, f32, sum_1, convert_element_type_default, bias)
view_default: f32[2, 12, 40] = aten.view(scaled_mm_azp_default, [2, 12, 40])
return [view_default]""")

    def test_zero_point_after_scaling_with_other_scales_stays_outside(self):
        def f(a, b, sa, sw, z, w_q):
            y = torch._int_mm(a, b).float() * sa
            return (y - (z.float() * sw) * w_q.sum(-1).float()) * sa

        z = torch.randint(-128, 128, (M, 1), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
        r, d = self.fused_in_part(f, (a, w.t(), sa, sa * 2, z, w))
        self.assertIn("scaled differently from the accumulator", d.reason)

    def test_int64_colsum_before_scaling_is_exact(self):
        """colsum from .sum() of an int32 tensor is int64: accepted, converted to int32
        (the corrected accumulator of int8 data fits int32), exact."""

        def f(a, b, sa, sb, azp, w_q):
            colsum = w_q.to(torch.int32).sum(1)  # int64 [N]
            acc = torch._int_mm(a, b) - azp * colsum
            return acc.float() * sa * sb

        azp = torch.randint(-8, 8, (M, 1), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
        args = (a, w.t(), sa, sb, azp, w)
        r = run_pass(f, *args)
        self.assertEqual(r.counts, {"int_mm_azp_per_token": 1})
        ref = (acc64(a, w.t()) - azp.double() * w.double().sum(1)) * sa.double() * sb.double()
        assert_policy(r.out, f(*args), ref)

    def test_int64_zero_point_of_any_range_is_exact(self):
        """int64 terms whose product passes int32: the op corrects in int64, as eager."""

        def f(a, b, sa, sb, azp, adj):
            return (torch._int_mm(a, b) - azp * adj).float() * sa * sb

        g = torch.Generator().manual_seed(5)
        azp = torch.randint(-2**20, 2**20, (M, 1), generator=g)  # int64
        adj = torch.randint(-2**20, 2**20, (N,), generator=g)  # int64: products near 2**40
        args = (a, w.t(), sa, sb, azp, adj)
        r = run_pass(f, *args)
        self.assertEqual(r.counts, {"int_mm_azp_per_token": 1})
        ref = (acc64(a, w.t()) - azp.double() * adj.double()) * sa.double() * sb.double()
        assert_policy(r.out, f(*args), ref)


class Block(torch.nn.Module):
    """A Llama-style MLP + residual written in plain torch with int8 linears, at M = 1: the
    residual [1, 1, N] and silu(gate) * up look like a bias and a per-channel scale."""

    def __init__(self, dim=64, hidden=96):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, (n, k) in {"o": (dim, dim), "gate": (hidden, dim), "up": (hidden, dim), "down": (dim, hidden)}.items():
            self.register_buffer(name, torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
            self.register_buffer(f"{name}_s", torch.rand(1, n, generator=g) / (64 * k**0.5))

    def linear(self, x, name):
        s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-6) / 127
        q = (x.float() / s).round().clamp(-128, 127).to(torch.int8)
        y = torch._int_mm(q.reshape(-1, q.shape[-1]), getattr(self, name).t()).float()
        return (y * s.reshape(-1, 1) * getattr(self, f"{name}_s")).to(x.dtype).reshape(*x.shape[:-1], -1)

    def forward(self, x):
        h = self.linear(x, "o") + x  # the residual after the epilogue
        return h + self.linear(F.silu(self.linear(h, "gate")) * self.linear(h, "up"), "down")


def test_m1_decoder_block_fuses_every_linear_and_names_no_fx_node():
    block = Block()
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    report = fusepass.explain(block, x)
    assert len(report.decisions) == 4 and all(d.fused for d in report.decisions), str(report)
    text = str(report)
    assert not re.search(r"\b(add|mul|sub|view|convert_element_type|_int_mm)_\d+\b", text), text
    assert "L['" not in text, text
    r = run_pass(block, x)
    with torch.no_grad():
        eager, ref = block(x), block(x.float())  # ref: the same quantized block, fp32 between
    # Each linear re-quantizes its input, so a rounding difference upstream can flip an
    # int8 value: compare distances to the fp32 run rather than bits.
    rel = lambda t: ((t.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(r.out) <= 1.5 * rel(eager) + 1e-3, (rel(r.out), rel(eager))
