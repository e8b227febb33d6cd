"""Patterns scaled_mm_fp8_epilogue, scaled_mm_fp8_direct and dequant_mm: torch._scaled_mm (fp8) with and without an epilogue, and
dequantize-then-matmul, -> fusepass.scaled_mm."""

import expecttest
import pytest
import torch

from fusepass.passes import PassConfig
from tests.support.helpers import COMPILES_F_SCALED_MM
from tests.passes.data import K, M, N, bias, f8, i8, scale
from tests.passes.harness import assert_policy, run_pass

F = torch.nn.functional


class TestScaledMMAndDequant(expecttest.TestCase):
    def check(self, fn, args, ref, pattern, **kw):
        r = run_pass(fn, *args, **kw)
        self.assertEqual(r.counts, {pattern: 1})
        assert_policy(r.out, fn(*args), ref)
        return r.after

    def test_scaled_mm_fp8_epilogue_scaled_mm_unit_scales_then_epilogue(self):
        def f(a, b, one, sa, sb, bias):
            y = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
            return (y * sa * sb + bias).to(torch.bfloat16)

        m = 8  # decode size: fp8 fuses at M <= PassConfig.fp8_max_m
        a, w, one = f8(m, K), f8(N, K, seed=1), torch.ones(())
        sa, sb, bs = scale(m, 1), scale(1, N, seed=2), bias()
        ref = a.double() @ w.double().t() * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(
            self.check(f, (a, w.t(), one, sa, sb, bs), ref, "scaled_mm_fp8_epilogue"), """\
reshape_default: f32[8] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
mul_tensor: f32[40] = aten.mul.Tensor(reshape_default_1, one)
mul_tensor_1: f32[40] = aten.mul.Tensor(mul_tensor, one)
scaled_mm_default: bf16[8, 40] = fusepass.scaled_mm(a, b, reshape_default, mul_tensor_1, bf16, bias)
return [scaled_mm_default]""")

    # scaled_mm_fp8_direct on CPU uses tensor-wise scales: torch 2.11's CPU _scaled_mm has no row-wise
    # scaling (2.13's has); the rewrite is the same, and the GPU tests cover row-wise.
    def test_scaled_mm_fp8_direct_scaled_mm_at_decode_size(self):
        def f(a, b, sa, sb, bias):
            return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)

        m = 8
        a, w, sa, sb = f8(m, K), f8(N, K, seed=1), scale(), scale(seed=2)
        bs = bias(dtype=torch.bfloat16)
        ref = a.double() @ w.double().t() * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, bs), ref, "scaled_mm_fp8_direct"), """\
scaled_mm_default: bf16[8, 40] = fusepass.scaled_mm(a, b, sa, sb, bf16, bias)
return [scaled_mm_default]""")

    def test_scaled_mm_fp8_kept_above_the_decode_threshold_alike(self):
        """One fp8 rule for the plain and the epilogue forms (an fp32 upcast for SiLU, say)."""

        def plain(a, b, sa, sb):
            return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

        def upcast_silu(a, b, sa, sb):  # (the upcast joins the epilogue: a step follows it)
            return F.silu(torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16).float() * 0.5)

        args = (f8(65, K), f8(N, K, seed=1).t(), scale(), scale(seed=2))
        for f, pattern in ((plain, "scaled_mm_fp8_direct"), (upcast_silu, "scaled_mm_fp8_epilogue")):
            r = run_pass(f, *args)
            self.assertEqual(r.counts, {})
            self.assertEqual(r.after, r.before)
            self.assertIn("kept on cuBLAS, which is faster than the fused kernel above M = 64", r.decisions[0].reason)
            r = run_pass(f, *args, config=PassConfig(fp8_max_m=80))
            self.assertEqual(r.counts, {pattern: 1})

    def test_scaled_mm_fp8_direct_views_alone_are_no_epilogue(self):
        def f(x, b, sa, sb):  # 3-D activations: only reshapes around the matmul
            y = torch._scaled_mm(x.reshape(-1, K), b, sa, sb, out_dtype=torch.bfloat16)
            return y.reshape(2, M // 2, N)

        x, w, sa, sb = f8(2, M // 2, K), f8(N, K, seed=1), scale(), scale(seed=2)
        ref = (x.double().reshape(-1, K) @ w.double().t() * sa.double() * sb.double()).reshape(2, M // 2, N)
        self.assertExpectedInline(self.check(f, (x, w.t(), sa, sb), ref, "scaled_mm_fp8_direct"), """\
view: f8e4m3[24, 64] = aten.view(x, [-1, 64])
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(view, b, sa, sb, bf16, None)
view_default: bf16[2, 12, 40] = aten.view(scaled_mm_default, [2, 12, 40])
return [view_default]""")

    @COMPILES_F_SCALED_MM
    def test_scaled_mm_fp8_functional_scaled_mm(self):
        """F.scaled_mm (aten._scaled_mm_v2): row-wise recipes, then a bias and a cast."""

        def f(a, b, sa, sb, bias):
            rw = F.ScalingType.RowWise
            return (F.scaled_mm(a, b, sa, rw, sb, rw, output_dtype=torch.float32) + bias).to(torch.bfloat16)

        m = 8
        a, w, sa, sb, bs = f8(m, K), f8(N, K, seed=1), scale(m, 1), scale(1, N, seed=2), bias()
        ref = a.double() @ w.double().t() * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, bs), ref, "scaled_mm_fp8_epilogue"), """\
reshape_default: f32[8] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
scaled_mm_default: bf16[8, 40] = fusepass.scaled_mm(a, b, reshape_default, reshape_default_1, bf16, bias)
return [scaled_mm_default]""")

    def test_dequant_mm_linear_of_dequantized_tensors(self):
        def f(xq, sx, wq, sw, bias):
            return F.linear(xq.float() * sx, wq.float() * sw, bias)

        xq, sx, wq, sw, bs = i8(M, K), scale(M, 1), i8(N, K, seed=1), scale(N, 1, seed=2), bias()
        ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t() + bs.double()
        self.assertExpectedInline(self.check(f, (xq, sx, wq, sw, bs), ref, "dequant_mm"), """\
permute_default: i8[64, 40] = aten.permute(wq, [1, 0])
reshape_default: f32[24] = aten.reshape(sx, [-1])
reshape_default_1: f32[40] = aten.reshape(sw, [-1])
scaled_mm_default: f32[24, 40] = fusepass.scaled_mm(xq, permute_default, reshape_default, reshape_default_1, f32, bias)
return [scaled_mm_default]""")

    def test_dequant_mm_3d_bf16_matmul_fp8(self):
        def f(xq, sx, wq, sw):
            return (xq.to(torch.bfloat16) * sx) @ (wq.to(torch.bfloat16) * sw).t()

        xq, sx = f8(2, 12, K), scale(2, 12, 1, dtype=torch.bfloat16)
        wq, sw = f8(N, K, seed=1), scale(N, 1, seed=2, dtype=torch.bfloat16)
        ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t()
        self.assertExpectedInline(self.check(f, (xq, sx, wq, sw), ref, "dequant_mm"), """\
view_default: f8e4m3[24, 64] = aten.view(xq, [24, 64])
permute_default: f8e4m3[64, 40] = aten.permute(wq, [1, 0])
reshape_default: bf16[24] = aten.reshape(sx, [-1])
reshape_default_1: bf16[40] = aten.reshape(sw, [-1])
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(view_default, permute_default, reshape_default, reshape_default_1, bf16, None)
view_default_1: bf16[2, 12, 40] = aten.view(scaled_mm_default, [2, 12, 40])
return [view_default_1]""")

    def test_dequant_mm_asymmetric_activation_per_token_zero_point(self):
        """torchao 0.17's asymmetric int8 on CUDA: ((x_q - z) * s_x) @ (w_q * s_w).t() in bf16."""

        def f(xq, zp, sx, wq, sw):
            x = ((xq.to(torch.bfloat16) - zp.to(torch.bfloat16)) * sx).to(torch.bfloat16)
            return x @ (wq.to(torch.bfloat16) * sw).t()

        xq, zp, sx = i8(2, 12, K), i8(2, 12, 1, seed=3), scale(2, 12, 1)
        wq, sw = i8(N, K, seed=1), scale(N, 1, seed=2, dtype=torch.bfloat16)
        ref = ((xq.double() - zp.double()) * sx.double()) @ (wq.double() * sw.double()).t()
        self.assertExpectedInline(self.check(f, (xq, zp, sx, wq, sw), ref, "dequant_mm"), """\
view_default: i8[24, 64] = aten.view(xq, [24, 64])
permute_default: i8[64, 40] = aten.permute(wq, [1, 0])
reshape_default: f32[24] = aten.reshape(sx, [-1])
reshape_default_1: bf16[40] = aten.reshape(sw, [-1])
sum_dim_int_list: i32[40] = aten.sum.dim_IntList(permute_default, [0], dtype=i32)
reshape_default_2: i8[24] = aten.reshape(zp, [-1])
convert_element_type_default: i32[24] = prims.convert_element_type(reshape_default_2, i32)
scaled_mm_azp_default: bf16[24, 40] = fusepass.scaled_mm_azp(view_default, permute_default, reshape_default, reshape_default_1, bf16, sum_dim_int_list, convert_element_type_default, None)
view_default_1: bf16[2, 12, 40] = aten.view(scaled_mm_azp_default, [2, 12, 40])
return [view_default_1]""")

    def test_dequant_mm_asymmetric_activation_per_tensor_zero_points(self):
        """A 0-d zero point, a Python number, and a per-token one at M = 1 fold into azp_adj."""
        wq, sw = i8(N, K, seed=1), scale(N, 1, seed=2)

        def tensor_zp(xq, zp, sx, wq, sw):
            return F.linear((xq.float() - zp.float()) * sx, wq.float() * sw)

        def number_zp(xq, sx, wq, sw):
            return F.linear((xq.float() - 3) * sx, wq.float() * sw)

        for m in (M, 1):
            xq, sx = i8(m, K), scale(m, 1)
            for fn, zp, args in ((tensor_zp, i8(1, seed=4) if m > 1 else i8(1, 1, seed=4), (xq, None, sx, wq, sw)),
                                 (number_zp, torch.tensor(3), (xq, sx, wq, sw))):
                if fn is tensor_zp:
                    args = (xq, zp, sx, wq, sw)
                ref = ((xq.double() - zp.double()) * sx.double()) @ (wq.double() * sw.double()).t()
                after = self.check(fn, args, ref, "dequant_mm")
                self.assertIn("aten.mul.Tensor(sum_dim_int_list", after)
                self.assertIn(", None)", after.splitlines()[-2])  # no per-token azp

    def test_dequant_mm_inductor_matrix_vector_decomposition(self):
        """Inductor decomposes an M = 1 bf16 mm on CUDA into a broadcast multiply and a sum."""

        def f(xq, zp, sx, wq, sw):
            x = ((xq.to(torch.bfloat16) - zp.to(torch.bfloat16)) * sx).to(torch.bfloat16)
            w = (wq.to(torch.bfloat16) * sw).t()
            return (x.float().unsqueeze(2) * w.float().unsqueeze(0)).sum(1).to(torch.bfloat16)

        xq, zp, sx = i8(1, K), i8(1, 1, seed=3), scale(1, 1)
        wq, sw = i8(N, K, seed=1), scale(N, 1, seed=2, dtype=torch.bfloat16)
        ref = ((xq.double() - zp.double()) * sx.double()) @ (wq.double() * sw.double()).t()
        self.assertExpectedInline(self.check(f, (xq, zp, sx, wq, sw), ref, "dequant_mm"), """\
permute_default: i8[64, 40] = aten.permute(wq, [1, 0])
reshape_default: bf16[40] = aten.reshape(sw, [-1])
reshape_default_1: f32[] = aten.reshape(sx, [])
sum_dim_int_list: i32[40] = aten.sum.dim_IntList(permute_default, [0], dtype=i32)
reshape_default_2: i8[1] = aten.reshape(zp, [-1])
mul_tensor: i32[40] = aten.mul.Tensor(sum_dim_int_list, reshape_default_2)
scaled_mm_azp_default: bf16[1, 40] = fusepass.scaled_mm_azp(xq, permute_default, reshape_default_1, reshape_default, bf16, mul_tensor, None, None)
return [scaled_mm_azp_default]""")
        r = run_pass(lambda x, w: (x.unsqueeze(2) * w.unsqueeze(0)).sum(1), torch.randn(1, K), torch.randn(K, N))
        self.assertEqual((r.counts, r.decisions), ({}, []))  # a float one is no candidate

    def test_dequant_mm_zero_points_that_do_not_fold(self):
        def fp8_zp(xq, sx, wq, sw):
            return F.linear((xq.float() - 1) * sx, wq.float() * sw)

        def weight_zp(xq, sx, wq, zw, sw):
            return F.linear(xq.float() * sx, (wq.float() - zw.float()) * sw)

        def zp_along_k(xq, zk, sx, wq, sw):
            return F.linear((xq.float() - zk.float()) * sx, wq.float() * sw)

        sx, sw = scale(M, 1), scale(N, 1, seed=2)
        for fn, args, why in (
            (fp8_zp, (f8(M, K), sx, f8(N, K, seed=1), sw), "zero points are int8 only"),
            (weight_zp, (i8(M, K), sx, i8(N, K, seed=1), i8(N, 1, seed=3), sw), "the weight has a zero point"),
            (zp_along_k, (i8(M, K), i8(K, seed=3), sx, i8(N, K, seed=1), sw), "varies along K"),
        ):
            r = run_pass(fn, *args)
            self.assertEqual((r.counts, r.after), ({}, r.before))
            self.assertIn(why, r.decisions[0].reason)

    def test_dequant_mm_dequantized_activation_with_other_users(self):
        """One dequantized activation feeds siblings' matmuls (a model that dequantizes once;
        Inductor's CSE under freezing), here beside a non-matmul user. Each matmul fuses on
        the quantized rows; the dequantization stays for the sum."""

        def linear(xq, sx, wq, sw, wq2, sw2):
            x = xq.float() * sx
            return F.linear(x, wq.float() * sw), F.linear(x, wq2.float() * sw2), x.sum()

        def matrix_vector(xq, sx, wq, sw, wq2, sw2):  # Inductor's M = 1 mm on CUDA, the product shared
            x = (xq.to(torch.bfloat16) * sx).float().unsqueeze(2)
            return tuple((x * (w.to(torch.bfloat16) * s).t().float().unsqueeze(0)).sum(1)
                         for w, s in ((wq, sw), (wq2, sw2))) + (x.sum(),)

        sw, sw2 = scale(N, 1, seed=2), scale(N, 1, seed=4)
        wq, wq2 = i8(N, K, seed=1), i8(N, K, seed=3)
        for fn, m in ((linear, M), (matrix_vector, 1)):
            xq, sx = i8(m, K), scale(m, 1)
            r = run_pass(fn, xq, sx, wq, sw, wq2, sw2, config=PassConfig(group_max_m=0))
            self.assertEqual(r.counts["dequant_mm"], 2, fn.__name__)
            self.assertEqual(r.after.count("= fusepass.scaled_mm("), 2)
            self.assertIn("aten.sum(", r.after)  # the other user's dequantization, kept
            eager = fn(xq, sx, wq, sw, wq2, sw2)
            for out, e, w, s in zip(r.out, eager, (wq, wq2), (sw, sw2)):
                assert_policy(out, e, (xq.double() * sx.double()) @ (w.double() * s.double()).t())
            torch.testing.assert_close(r.out[2], eager[2])

    def test_dequant_mm_dequantized_weight_with_another_user_is_left(self):
        def f(xq, sx, wq, sw):
            w = wq.float() * sw
            return F.linear(xq.float() * sx, w), w.sum()

        r = run_pass(f, i8(M, K), scale(M, 1), i8(N, K, seed=1), scale(N, 1, seed=2))
        self.assertEqual((r.counts, r.after), ({}, r.before))
        self.assertRegex(r.decisions[0].reason, r"the dequantized weight \w+ has 2 users")

    def test_plain_float_matmul_is_not_a_candidate(self):
        r = run_pass(lambda x, w: F.linear(x, w), torch.randn(M, K), torch.randn(N, K))
        self.assertEqual((r.counts, r.decisions, r.after), ({}, [], r.before))


@pytest.mark.parametrize("M_", [1, 64, 65])
def test_scaled_mm_fp8_direct_threshold_is_inclusive(M_):
    def f(a, b, sa, sb):
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

    r = run_pass(f, f8(M_, K), f8(N, K, seed=1).t(), scale(), scale(seed=2))
    assert r.counts == ({"scaled_mm_fp8_direct": 1} if M_ <= 64 else {})
