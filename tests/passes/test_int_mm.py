"""Patterns int_mm_scaled, int_mm_azp_per_tensor, int_mm_azp_per_token: torch._int_mm and its epilogue -> fusepass.scaled_mm / scaled_mm_azp."""

import expecttest
import pytest
import torch

from tests.passes.data import K, M, N, bias, i8, scale
from tests.passes.harness import assert_policy, run_pass

F = torch.nn.functional


def acc64(a, b):
    return a.double() @ b.double()


class TestIntMM(expecttest.TestCase):
    def check(self, fn, args, ref, pattern):
        r = run_pass(fn, *args)
        self.assertEqual(r.counts, {pattern: 1})
        assert_policy(r.out, fn(*args), ref)
        return r.after

    def test_int_mm_scaled_scales_then_bias_then_cast(self):
        def f(a, b, sa, sb, bias):
            return (torch._int_mm(a, b).float() * sa * sb + bias).to(torch.bfloat16)

        a, w, sa, sb, bs = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(1, N, seed=2), bias()
        ref = acc64(a, w.t()) * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, bs), ref, "int_mm_scaled"), """\
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(a, b, reshape_default, reshape_default_1, bf16, bias)
return [scaled_mm_default]""")

    def test_int_mm_scaled_premultiplied_any_order_fp32_out(self):
        def f(a, b, sa, sb):
            s = sa * sb  # an [M, N] outer product of per-token and per-channel scales
            return s * torch._int_mm(a, b).to(torch.float32)

        a, w, sa, sb = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(N, seed=2)
        ref = acc64(a, w.t()) * sa.double() * sb.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb), ref, "int_mm_scaled"), """\
reshape_default: f32[24] = aten.reshape(sa, [-1])
scaled_mm_default: f32[24, 40] = fusepass.scaled_mm(a, b, reshape_default, sb, f32, None)
return [scaled_mm_default]""")

    def test_int_mm_scaled_python_and_0d_scales_fp16(self):
        def f(a, b, s, bias):
            return (0.5 * (torch._int_mm(a, b).float() * s) + bias).half()

        a, w, s, bs = i8(M, K), i8(N, K, seed=1), scale(seed=2).reshape(()), bias()
        ref = acc64(a, w.t()) * 0.5 * s.double() + bs.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), s, bs), ref, "int_mm_scaled"), """\
full_default: f32[] = aten.full([], 0.5, dtype=f32, device=device(type='cpu'))
scaled_mm_default: f16[24, 40] = fusepass.scaled_mm(a, b, s, full_default, f16, bias)
return [scaled_mm_default]""")

    def test_int_mm_scaled_vector_scales_unsqueezed(self):
        def f(a, b, sa, sb):
            return torch._int_mm(a, b).float() * sa.unsqueeze(1) * sb

        a, w, sa, sb = i8(M, K), i8(N, K, seed=1), scale(M), scale(N, seed=2)
        ref = acc64(a, w.t()) * sa.double()[:, None] * sb.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb), ref, "int_mm_scaled"), """\
unsqueeze: f32[24, 1] = aten.unsqueeze(sa, 1)
reshape_default: f32[24] = aten.reshape(unsqueeze, [-1])
scaled_mm_default: f32[24, 40] = fusepass.scaled_mm(a, b, reshape_default, sb, f32, None)
return [scaled_mm_default]""")

    def test_int_mm_scaled_cast_to_out_dtype_before_scale_b_and_bias(self):
        def f(a, b, sa, sb, bias):  # torchao's order: rounds to bf16 twice on the way
            y = torch._int_mm(a, b).to(torch.bfloat16) * sa.to(torch.bfloat16)
            return y * sb + bias

        a, w = i8(M, K), i8(N, K, seed=1)
        sa, sb, bs = scale(M, 1), scale(N, seed=2, dtype=torch.bfloat16), bias(dtype=torch.bfloat16)
        ref = acc64(a, w.t()) * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, bs), ref, "int_mm_scaled"), """\
convert_element_type_1: bf16[24, 1] = prims.convert_element_type(sa, bf16)
reshape_default: bf16[24] = aten.reshape(convert_element_type_1, [-1])
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(a, b, reshape_default, sb, bf16, bias)
return [scaled_mm_default]""")

    def test_int_mm_scaled_lone_bf16_scales_go_in_uncast(self):
        """A bf16 per-tensor and a bf16 per-channel scale, each alone on its side: the op
        widens them itself (no cast kernel for a weight's scale every step)."""
        def f(a, b, sa, sb):
            return (torch._int_mm(a, b).to(torch.bfloat16) * sa) * sb

        a, w = i8(M, K), i8(N, K, seed=1)
        sa, sb = scale(seed=3, dtype=torch.bfloat16).reshape(()), scale(N, seed=2, dtype=torch.bfloat16)
        ref = acc64(a, w.t()) * sa.double() * sb.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb), ref, "int_mm_scaled"), """\
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(a, b, sa, sb, bf16, None)
return [scaled_mm_default]""")

    def test_int_mm_scaled_3d_activations_with_reshapes(self):
        def f(x, w, sa, sb, bias):
            B, S, _ = x.shape
            y = torch._int_mm(x.reshape(-1, K), w.t()).float() * sa.reshape(-1, 1)
            return (y.reshape(B, S, N) * sb + bias).to(torch.bfloat16)

        x, w, sa, sb, bs = i8(2, 12, K), i8(N, K, seed=1), scale(2, 12, 1), scale(N, seed=2), bias()
        ref = (acc64(x.reshape(-1, K), w.t()) * sa.reshape(-1, 1).double() * sb.double() + bs.double()).reshape(2, 12, N)
        self.assertExpectedInline(self.check(f, (x, w, sa, sb, bs), ref, "int_mm_scaled"), """\
view: i8[24, 64] = aten.view(x, [-1, 64])
permute: i8[64, 40] = aten.permute(w, [1, 0])
view_1: f32[24, 1] = aten.view(sa, [-1, 1])
reshape_default: f32[24] = aten.reshape(view_1, [-1])
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(view, permute, reshape_default, sb, bf16, bias)
view_default: bf16[2, 12, 40] = aten.view(scaled_mm_default, [2, 12, 40])
return [view_default]""")

    def test_int_mm_azp_per_tensor_per_tensor_zero_point_adj(self):
        def f(a, b, sa, sb, azp_adj):
            return (torch._int_mm(a, b) - azp_adj).float() * sa * sb

        a, w, sa, sb = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(1, N, seed=2)
        adj = 3 * w.sum(1, dtype=torch.int32)
        ref = (acc64(a, w.t()) - adj.double()) * sa.double() * sb.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, adj), ref, "int_mm_azp_per_tensor"), """\
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
scaled_mm_azp_default: f32[24, 40] = fusepass.scaled_mm_azp(a, b, reshape_default, reshape_default_1, f32, azp_adj, None, None)
return [scaled_mm_azp_default]""")

    def test_int_mm_azp_per_tensor_z_times_colsum(self):
        def f(a, w, sa, sb, bias):
            colsum = w.sum(1, dtype=torch.int32)
            acc = torch._int_mm(a, w.t()) - 5 * colsum
            return (acc.float() * sa * sb + bias).to(torch.bfloat16)

        a, w, sa, sb, bs = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(1, N, seed=2), bias()
        ref = (acc64(a, w.t()) - 5 * w.double().sum(1)) * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(self.check(f, (a, w, sa, sb, bs), ref, "int_mm_azp_per_tensor"), """\
sum_1: i32[40] = aten.sum.dim_IntList(w, [1], dtype=i32)
permute: i8[64, 40] = aten.permute(w, [1, 0])
mul: i32[40] = aten.mul.Tensor(sum_1, 5)
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
scaled_mm_azp_default: bf16[24, 40] = fusepass.scaled_mm_azp(a, permute, reshape_default, reshape_default_1, bf16, mul, None, bias)
return [scaled_mm_azp_default]""")

    def test_int_mm_azp_per_token_per_token_zero_point(self):
        def f(a, b, sa, sb, azp, adj, bias):
            acc = torch._int_mm(a, b) - azp.view(-1, 1) * adj.view(1, -1)
            return (acc.float() * sa * sb + bias).half()

        a, w, sa, sb, bs = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(1, N, seed=2), bias()
        azp = torch.randint(-20, 20, (M,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
        adj = w.sum(1, dtype=torch.int32)
        ref = (acc64(a, w.t()) - azp.double()[:, None] * adj.double()) * sa.double() * sb.double() + bs.double()
        self.assertExpectedInline(
            self.check(f, (a, w.t(), sa, sb, azp, adj, bs), ref, "int_mm_azp_per_token"), """\
view: i32[24, 1] = aten.view(azp, [-1, 1])
view_1: i32[1, 40] = aten.view(adj, [1, -1])
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
reshape_default_2: i32[24] = aten.reshape(view, [-1])
reshape_default_3: i32[40] = aten.reshape(view_1, [-1])
scaled_mm_azp_default: f16[24, 40] = fusepass.scaled_mm_azp(a, b, reshape_default, reshape_default_1, f16, reshape_default_3, reshape_default_2, bias)
return [scaled_mm_azp_default]""")

    def test_int_mm_azp_per_token_at_one_row_keeps_the_zero_point_apart(self):
        """At M = 1 ``azp[1, 1] * adj[1, N]`` is also a [1, N] term; read as per-token, the op
        takes the stored ``adj`` (siblings' slices of one buffer then join) instead of a product
        computed on every call."""
        def f(a, b, sa, sb, azp, adj):
            acc = torch._int_mm(a, b) - azp.view(-1, 1) * adj.view(1, -1)
            return (acc.float() * sa * sb).to(torch.bfloat16)

        a, w, sa, sb = i8(1, K), i8(N, K, seed=1), scale(1, 1), scale(1, N, seed=2)
        azp, adj = torch.tensor([7], dtype=torch.int32), w.sum(1, dtype=torch.int32)
        ref = (acc64(a, w.t()) - 7 * adj.double()) * sa.double() * sb.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, azp, adj), ref, "int_mm_azp_per_token"), """\
view: i32[1, 1] = aten.view(azp, [-1, 1])
view_1: i32[1, 40] = aten.view(adj, [1, -1])
reshape_default: f32[40] = aten.reshape(sb, [-1])
reshape_default_1: f32[] = aten.reshape(sa, [])
reshape_default_2: i32[1] = aten.reshape(view, [-1])
reshape_default_3: i32[40] = aten.reshape(view_1, [-1])
scaled_mm_azp_default: bf16[1, 40] = fusepass.scaled_mm_azp(a, b, reshape_default_1, reshape_default, bf16, reshape_default_3, reshape_default_2, None)
return [scaled_mm_azp_default]""")

    def test_int_mm_azp_per_tensor_at_one_row_where_a_factor_cannot_be_an_operand(self):
        """The one-row reading of int_mm_azp_per_token needs both factors as op operands; a CPU scalar zero
        point (a number to eager broadcasting) or a bf16 one stays the per-tensor product."""
        def f(a, b, sa, sb, z, colsum):
            acc = torch._int_mm(a, b) - z * colsum.view(1, -1)
            return (acc.float() * sa * sb).to(torch.bfloat16)

        a, w, sa, sb = i8(1, K), i8(N, K, seed=1), scale(1, 1), scale(1, N, seed=2)
        colsum = w.sum(1, dtype=torch.int32)
        for z in (torch.tensor(7, dtype=torch.int32), torch.full((1, 1), 7.0, dtype=torch.bfloat16)):
            with self.subTest(z=str(z.dtype)):  # (a str: pytest-xdist cannot send a dtype)
                ref = (acc64(a, w.t()) - 7 * colsum.double()) * sa.double() * sb.double()
                self.check(f, (a, w.t(), sa, sb, z, colsum.float() if z.is_floating_point() else colsum), ref,
                           "int_mm_azp_per_tensor")

    @pytest.mark.skipif(torch.__version__ < "2.12", reason="torch._int_mm takes uint8 activations from 2.12 on")
    def test_u8s8_shift_cancels_and_an_asymmetric_zero_point_follows(self):
        """torchao 0.18's CPU form on AVX512-VNNI without AMX (``_int_scaled_matmul_cpu``):
        ``a`` shifted to uint8 and the shift taken off the int32 result, then its asymmetric
        activation's zero point subtracted after the row scale (``Int8Tensor``'s linear)."""
        def f(a, w, sa, sb, zp):
            b = w.t()
            acc = torch._int_mm((a.to(torch.int32) + 128).to(torch.uint8), b)
            acc = acc - b.sum(dim=0, keepdim=True, dtype=torch.int32) * 128
            y = (acc.to(torch.float32) * sa).to(torch.bfloat16)
            y = y - ((zp.to(torch.float32) * sa) * w.sum(dim=-1).to(torch.float32)).to(torch.bfloat16)
            return y * sb

        a, w, sa = i8(M, K), i8(N, K, seed=1), scale(M, 1)
        sb = scale(N, seed=2, dtype=torch.bfloat16)
        zp = torch.randint(-20, 20, (M, 1), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
        ref = (acc64(a, w.t()) - zp.double() * w.double().sum(1)) * sa.double() * sb.double()
        self.assertExpectedInline(self.check(f, (a, w, sa, sb, zp), ref, "int_mm_azp_per_token"), """\
permute: i8[64, 40] = aten.permute(w, [1, 0])
sum_2: i64[40] = aten.sum.dim_IntList(w, [-1])
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: i8[24] = aten.reshape(zp, [-1])
convert_element_type_default: i32[24] = prims.convert_element_type(reshape_default_1, i32)
scaled_mm_azp_default: bf16[24, 40] = fusepass.scaled_mm_azp(a, permute, reshape_default, sb, bf16, sum_2, convert_element_type_default, None)
return [scaled_mm_azp_default]""")

    @pytest.mark.skipif(torch.__version__ < "2.12", reason="torch._int_mm takes uint8 activations from 2.12 on")
    def test_u8s8_shift_cancels(self):
        def f(a, b, sa, sb):
            acc = torch._int_mm((a.to(torch.int32) + 128).to(torch.uint8), b)
            acc = acc - b.sum(dim=0, keepdim=True, dtype=torch.int32) * 128
            return (acc.to(torch.float32) * sa).to(torch.bfloat16) * sb

        a, w, sa, sb = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(N, seed=2, dtype=torch.bfloat16)
        ref = acc64(a, w.t()) * sa.double() * sb.double()
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb), ref, "int_mm_scaled"), """\
reshape_default: f32[24] = aten.reshape(sa, [-1])
scaled_mm_default: bf16[24, 40] = fusepass.scaled_mm(a, b, reshape_default, sb, bf16, None)
return [scaled_mm_default]""")

    def test_epilogue_ends_before_a_residual_add_and_relu(self):
        def f(a, b, sa, sb, bias, res):
            y = torch._int_mm(a, b).float() * sa * sb + bias
            return torch.relu(y + res)

        a, w, sa, sb, bs = i8(M, K), i8(N, K, seed=1), scale(M, 1), scale(1, N, seed=2), bias()
        res = torch.randn(M, N)
        ref = torch.relu(acc64(a, w.t()) * sa.double() * sb.double() + bs.double() + res.double())
        self.assertExpectedInline(self.check(f, (a, w.t(), sa, sb, bs, res), ref, "int_mm_scaled"), """\
reshape_default: f32[24] = aten.reshape(sa, [-1])
reshape_default_1: f32[40] = aten.reshape(sb, [-1])
scaled_mm_default: f32[24, 40] = fusepass.scaled_mm(a, b, reshape_default, reshape_default_1, f32, bias)
add_1: f32[24, 40] = aten.add.Tensor(scaled_mm_default, res)
relu: f32[24, 40] = aten.relu(add_1)
return [relu]""")
