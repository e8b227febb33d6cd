"""Symbolic M: the rewrite still happens and a new M does not recompile."""

import expecttest
import torch

from tests.passes.data import K, N, bias, i8, scale
from tests.passes.harness import assert_policy, run_pass


def linear3d(x, w, sx, sw, bias):
    B, S, _ = x.shape
    y = torch._int_mm(x.reshape(-1, K), w.t()).float() * sx.reshape(-1, 1) * sw
    return (y + bias).reshape(B, S, N).to(torch.bfloat16)


def inputs(B, S, seed=0):
    return i8(B, S, K, seed=seed), i8(N, K, seed=1), scale(B, S, 1, seed=seed), scale(N, seed=2), bias()


def ref(x, w, sx, sw, bias):
    y = (x.reshape(-1, K).double() @ w.double().t()) * sx.reshape(-1, 1).double() * sw.double() + bias.double()
    return y.reshape(x.shape[0], x.shape[1], N)


class TestDynamic(expecttest.TestCase):
    def test_dynamic_true_fuses_once_for_every_m(self):
        first, second = inputs(2, 9), inputs(3, 17, seed=4)
        r = run_pass(linear3d, *first, dynamic=True, calls=[second])
        self.assertEqual(r.compiles, 1)
        self.assertEqual(r.counts, {"int_mm_scaled": 1})
        assert_policy(r.out, linear3d(*first), ref(*first))
        self.assertExpectedInline(r.after, """\
view: i8[S0*S1, 64] = aten.view(x, [-1, 64])
permute: i8[64, 40] = aten.permute(w, [1, 0])
view_1: f32[S0*S1, 1] = aten.view(sx, [-1, 1])
reshape_default: f32[S0*S1] = aten.reshape(view_1, [-1])
scaled_mm_default: bf16[S0*S1, 40] = fusepass.scaled_mm(view, permute, reshape_default, sw, bf16, bias)
view_default: bf16[S1, S0, 40] = aten.view(scaled_mm_default, [S1, S0, 40])
return [view_default]""")

    def test_mark_dynamic_token_dim(self):
        x, *rest = inputs(1, 24)
        x2d = x.reshape(24, K)
        torch._dynamo.mark_dynamic(x2d, 0)

        def f(x, w, sw):
            return torch._int_mm(x, w.t()).float() * sw

        more = (i8(40, K, seed=3), rest[0], rest[2])
        r = run_pass(f, x2d, rest[0], rest[2], calls=[more])
        self.assertEqual((r.compiles, r.counts), (1, {"int_mm_scaled": 1}))
        self.assertIn("fusepass.scaled_mm(x, ", r.after)
        self.assertIn("f32[S0", r.after)  # the output's M is symbolic
