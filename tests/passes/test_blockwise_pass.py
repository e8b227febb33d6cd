"""Block-wise fp8 (patterns/blockwise.py): torch._scaled_mm / F.scaled_mm with 1x128 x 128x128
scales, and dequantize-then-matmul with block scales, -> fusepass.scaled_mm_blockwise; and
what must stay as it is.

CPU torch._scaled_mm has no block-wise mode, so those graphs are checked against the float64
oracle; the dequantize forms run eagerly too and are checked by harness.assert_policy."""

import re

import expecttest
import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.backend import capture_backend
from fusepass.passes import FusePass
from tests.support.blockwise_data import BlockProblem, block_oracle, make_block_problem
from tests.support.helpers import COMPILES_F_SCALED_MM, assert_matches_oracle
from tests.passes.harness import assert_policy, run_pass

F = torch.nn.functional
BF16 = torch.bfloat16
M, N, K = 8, 200, 300  # decode size; K ragged over 3 groups (last 44 wide), N over 2 blocks


def scaled(a, b, sa, sb, bias):
    return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=BF16)


def dequant_linear(x, sx, w, sw, bias):
    """The DeepSeek reference form: scales spread by repeat_interleave, sliced to ragged sizes."""
    k, n = x.shape[-1], w.shape[0]
    xd = x.to(BF16) * sx.repeat_interleave(128, -1)[..., :k]
    wd = w.to(BF16) * sw.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return F.linear(xd, wd, bias).to(BF16)


def _block(x, sx, w, sw, bias=None) -> BlockProblem:
    """The problem a dequantize-then-linear form computes, for the oracle."""
    return BlockProblem(x.reshape(-1, x.shape[-1]), w.t(), sx.reshape(-1, sx.shape[-1]), sw.t(), bias)


class TestBlockwise(expecttest.TestCase):
    def fused(self, fn, args, pattern, **kw):
        r = run_pass(fn, *args, **kw)
        self.assertEqual(r.counts, {pattern: 1}, [d.reason for d in r.decisions])
        return r

    def test_scaled_mm_with_cublas_layouts(self):
        p = make_block_problem(M, N, K, bias_dtype=BF16, m_major=True)  # scale_b = w_scale.t()
        r = self.fused(scaled, (p.a, p.b, p.scale_a, p.scale_b, p.bias), "scaled_mm_blockwise")
        assert_matches_oracle(r.out, p, BF16, oracle=block_oracle)
        self.assertExpectedInline(r.after, """\
scaled_mm_blockwise_default: bf16[8, 200] = fusepass.scaled_mm_blockwise(a, b, sa, sb, bf16, bias)
return [scaled_mm_blockwise_default]""")

    def test_scaled_mm_on_cpu_at_any_m(self):
        """Above PassConfig.fp8_max_m too: CPU torch._scaled_mm cannot run block-wise scales."""
        p = make_block_problem(40, N, K)
        r = self.fused(scaled, (p.a, p.b, p.scale_a, p.scale_b, None), "scaled_mm_blockwise")
        assert_matches_oracle(r.out, p, BF16, oracle=block_oracle)

    def test_scaled_mm_epilogue_folds_token_and_tensor_factors(self):
        def f(a, b, sa, sb, s_tok):
            return (torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32) * s_tok * 0.5).to(BF16)

        p, s_tok = make_block_problem(M, N, K), torch.rand(M, 1)
        r = self.fused(f, (p.a, p.b, p.scale_a, p.scale_b, s_tok), "scaled_mm_blockwise")
        p.scale_a = p.scale_a * s_tok * 0.5  # (exact: a power of two, and one fp32 product)
        assert_matches_oracle(r.out, p, BF16, oracle=block_oracle)
        self.assertExpectedInline(r.after, """\
reshape_default: f32[8] = aten.reshape(s_tok, [-1])
full_default: f32[] = aten.full([], 0.5, dtype=f32, device=device(type='cpu'))
mul_tensor: f32[8] = aten.mul.Tensor(reshape_default, full_default)
reshape_default_1: f32[8, 1] = aten.reshape(mul_tensor, [-1, 1])
mul_tensor_1: f32[8, 3] = aten.mul.Tensor(sa, reshape_default_1)
scaled_mm_blockwise_default: bf16[8, 200] = fusepass.scaled_mm_blockwise(a, b, mul_tensor_1, sb, bf16, None)
return [scaled_mm_blockwise_default]""")

    def test_scaled_mm_per_channel_multiply_stays_outside(self):
        def f(a, b, sa, sb, s_col):
            return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32) * s_col

        p = make_block_problem(M, N, K)
        r = self.fused(f, (p.a, p.b, p.scale_a, p.scale_b, torch.rand(N)), "scaled_mm_blockwise")
        (d,) = r.decisions
        self.assertTrue(d.partial)
        self.assertIn("a per-channel multiply follows a block-wise matmul", d.reason)
        self.assertExpectedInline(r.after, """\
scaled_mm_blockwise_default: f32[8, 200] = fusepass.scaled_mm_blockwise(a, b, sa, sb, f32, None)
mul: f32[8, 200] = aten.mul.Tensor(scaled_mm_blockwise_default, s_col)
return [mul]""")

    @COMPILES_F_SCALED_MM
    def test_functional_scaled_mm_padded_scale_b(self):
        """cuBLAS's layouts: M-major scale_a, scale_b's K blocks padded to 4 (torch's meta checks
        take floor(K/128) here, so K and N are whole blocks)."""

        def f(a, b, sa, sb):
            return F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                               output_dtype=BF16)

        p = make_block_problem(M, 256, 384, m_major=True)
        padded = torch.cat([p.scale_b.t(), torch.full((2, 1), float("nan"))], dim=1).t()  # [4, 2], stride (1, 4)
        r = self.fused(f, (p.a, p.b, p.scale_a, padded), "scaled_mm_blockwise")
        assert_matches_oracle(r.out, p, BF16, oracle=block_oracle)  # the NaN padding is never read
        self.assertExpectedInline(r.after, """\
slice_tensor: f32[3, 2] = aten.slice.Tensor(sb, 0, 0, 3)
scaled_mm_blockwise_default: bf16[8, 256] = fusepass.scaled_mm_blockwise(a, b, sa, slice_tensor, bf16, None)
return [scaled_mm_blockwise_default]""")

    def test_dequant_linear_3d_ragged_with_bias(self):
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(2, 4, K, generator=g) * 2).to(torch.float8_e4m3fn)
        w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
        sx, sw, bias = torch.rand(2, 4, 3, generator=g), torch.rand(2, 3, generator=g), torch.randn(N, generator=g)
        r = self.fused(dequant_linear, (x, sx, w, sw, bias), "dequant_mm_blockwise")
        ref = block_oracle(_block(x, sx, w, sw, bias))[0].reshape(2, 4, N)
        assert_policy(r.out, dequant_linear(x, sx, w, sw, bias), ref)
        self.assertExpectedInline(r.after, """\
view_default: f8e4m3[8, 300] = aten.view(x, [8, 300])
permute_default: f8e4m3[300, 200] = aten.permute(w, [1, 0])
reshape_default: f32[8, 3] = aten.reshape(sx, [-1, 3])
permute_default_1: f32[3, 2] = aten.permute(sw, [1, 0])
scaled_mm_blockwise_default: bf16[8, 200] = fusepass.scaled_mm_blockwise(view_default, permute_default, reshape_default, permute_default_1, bf16, bias)
view_default_1: bf16[2, 4, 200] = aten.view(scaled_mm_blockwise_default, [2, 4, 200])
return [view_default_1]""")

    def test_dequant_activation_shared_by_siblings(self):
        """One dequantized activation for two weights (a model that dequantizes once; Inductor's
        CSE under freezing), and a non-matmul user: both matmuls fuse, the
        dequantization stays for the sum."""
        g = torch.Generator().manual_seed(2)
        x, w, w2 = ((torch.randn(*s, generator=g) * 2).to(torch.float8_e4m3fn) for s in ((M, K), (N, K), (N, K)))
        sx, sw, sw2 = torch.rand(M, 3, generator=g), torch.rand(2, 3, generator=g), torch.rand(2, 3, generator=g)

        def f(x, sx, w, sw, w2, sw2):
            xd = x.to(BF16) * sx.repeat_interleave(128, -1)[..., :K]
            ys = tuple(F.linear(xd, wq.to(BF16) * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K])
                       for wq, s in ((w, sw), (w2, sw2)))
            return ys + (xd.float().sum(),)

        r = run_pass(f, x, sx, w, sw, w2, sw2)
        self.assertEqual(r.counts["dequant_mm_blockwise"], 2, [d.reason for d in r.decisions])
        self.assertEqual(r.after.count("= fusepass.scaled_mm_blockwise("), 2)
        eager = f(x, sx, w, sw, w2, sw2)
        for out, e, wq, s in zip(r.out, eager, (w, w2), (sw, sw2)):
            assert_policy(out, e, block_oracle(_block(x, sx, wq, s))[0])
        torch.testing.assert_close(r.out[2], eager[2])

    def test_dequant_grouped_view_and_expanded_weight_scale(self):
        def f(x, sx, w, sw):
            m, k = x.shape
            xd = (x.view(m, -1, 128).to(BF16) * sx[:, :, None]).view(m, k)
            wd = w.to(BF16) * sw[:, None, :, None].expand(-1, 128, -1, 128).reshape(w.shape)
            return xd @ wd.t()

        p = make_block_problem(M, 256, 384)
        x, sx, w, sw = p.a, p.scale_a, p.b.t(), p.scale_b.t()
        r = self.fused(f, (x, sx, w, sw), "dequant_mm_blockwise")
        assert_policy(r.out, f(x, sx, w, sw), block_oracle(p)[0])
        self.assertExpectedInline(r.after, """\
permute_default: f8e4m3[384, 256] = aten.permute(w, [1, 0])
permute_default_1: f32[3, 2] = aten.permute(sw, [1, 0])
scaled_mm_blockwise_default: f32[8, 256] = fusepass.scaled_mm_blockwise(x, permute_default, sx, permute_default_1, f32, None)
return [scaled_mm_blockwise_default]""")

    def test_dequant_per_tensor_weight_scale_with_block_activations(self):
        def f(x, sx, w, sw):
            xd = (x.to(BF16) * sx.repeat_interleave(128, 1)[:, :K]).to(BF16)  # a 0-d fp32 sw keeps wd bf16
            return F.linear(xd, w.to(BF16) * sw)

        p = make_block_problem(M, N, K)
        x, sx, w, sw = p.a, p.scale_a, p.b.t(), torch.rand(())
        r = self.fused(f, (x, sx, w, sw), "dequant_mm_blockwise")
        p.scale_b = sw.expand(p.scale_b.shape)
        assert_policy(r.out, f(x, sx, w, sw), block_oracle(p)[0])
        self.assertExpectedInline(r.after, """\
permute_default: f8e4m3[300, 200] = aten.permute(w, [1, 0])
reshape_default: f32[1, 1] = aten.reshape(sw, [1, 1])
expand_default: f32[3, 2] = aten.expand(reshape_default, [3, 2])
scaled_mm_blockwise_default: bf16[8, 200] = fusepass.scaled_mm_blockwise(x, permute_default, sx, expand_default, bf16, None)
return [scaled_mm_blockwise_default]""")

    def test_dequant_scales_sliced_from_a_buffers_first_rows(self):
        """Scales cut from the first rows of larger buffers (a joined buffer's first member, a
        preallocated activation-scale buffer), one row or several: each slice is the source
        (read whole), not the buffer, which the spread reads only in part."""
        def f(x, sx_buf, w, sw_buf):
            m, n = x.shape[0], w.shape[0]
            xd = x.to(BF16) * sx_buf[:m].repeat_interleave(128, 1)
            wd = w.to(BF16) * sw_buf[:n // 128].repeat_interleave(128, 0).repeat_interleave(128, 1)
            return F.linear(xd, wd)

        for n in (128, 256):
            with self.subTest(n=n):
                p = make_block_problem(M, n, 256)
                x, w = p.a, p.b.t()
                sx_buf = torch.cat([p.scale_a, torch.rand(3, 2)])  # (M + 3, K / 128)
                sw_buf = torch.cat([p.scale_b.t(), torch.rand(2, 2)])  # (N / 128 + 2, K / 128)
                r = self.fused(f, (x, sx_buf, w, sw_buf), "dequant_mm_blockwise")
                assert_policy(r.out, f(x, sx_buf, w, sw_buf), block_oracle(p)[0])

    def test_dequant_scale_cut_from_a_buffer_at_a_symbolic_m(self):
        """``buf[:m]`` at a dynamic M: the slice's bound is a size node in the graph; fused,
        once, the slice the source; a buffer of another shape too (both dynamic)."""
        def f(x, sx_buf, w, sw):
            xd = x.to(BF16) * sx_buf[:x.shape[0]].repeat_interleave(128, 1)
            return F.linear(xd, w.to(BF16) * sw.repeat_interleave(128, 0).repeat_interleave(128, 1))

        p, q = make_block_problem(M, 256, 256), make_block_problem(20, 256, 256, seed=1)
        w, sw = p.b.t(), p.scale_b.t()
        x, buf = p.a.clone(), torch.cat([p.scale_a, torch.rand(3, 2)])
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(buf, 0)
        r = run_pass(f, x, buf, w, sw, calls=[(q.a, torch.cat([q.scale_a, torch.rand(5, 2)]), w, sw)])
        self.assertEqual((r.counts, r.compiles), ({"dequant_mm_blockwise": 1}, 1))
        assert_policy(r.out, f(x, buf, w, sw), block_oracle(p)[0])

    def test_dequant_scale_rows_of_a_flattened_buffer_read_in_part(self):
        """``buf.view(12, 2)[:9]`` of a (3, 4, 2) buffer reads its first two dims' digits each
        fully but not every pair: the slice is the source, not the buffer."""
        def f(x, sbuf, w, sw):
            xd = x.to(BF16) * sbuf.view(12, 2)[:9].repeat_interleave(128, 1)
            return F.linear(xd, w.to(BF16) * sw.repeat_interleave(128, 0).repeat_interleave(128, 1))

        p = make_block_problem(9, 256, 256)
        sbuf = torch.cat([p.scale_a, torch.rand(3, 2)]).view(3, 4, 2)
        r = self.fused(f, (p.a, sbuf, p.b.t(), p.scale_b.t()), "dequant_mm_blockwise")
        assert_policy(r.out, f(p.a, sbuf, p.b.t(), p.scale_b.t()), block_oracle(p)[0])

    def test_dequant_dynamic_m_compiles_once(self):
        p = make_block_problem(M, N, K)
        w, sw = p.b.t(), p.scale_b.t()

        def f(x, sx):  # the weight and its scales are the model's (static) parameters
            return dequant_linear(x, sx, w, sw, None)

        q = make_block_problem(20, N, K, seed=1)
        torch._dynamo.mark_dynamic(p.a, 0)
        torch._dynamo.mark_dynamic(p.scale_a, 0)
        r = self.fused(f, (p.a, p.scale_a), "dequant_mm_blockwise", calls=[(q.a, q.scale_a)])
        self.assertEqual(r.compiles, 1)
        assert_policy(r.out, f(p.a, p.scale_a), block_oracle(p)[0])
        self.assertExpectedInline(r.after, """\
permute_default: f8e4m3[300, 200] = aten.permute(w, [1, 0])
permute_default_1: f32[3, 2] = aten.permute(sw, [1, 0])
scaled_mm_blockwise_default: bf16[S0, 200] = fusepass.scaled_mm_blockwise(x, permute_default, sx, permute_default_1, bf16, None)
return [scaled_mm_blockwise_default]""")

    def test_lowered_to_the_reference_on_cpu(self):
        """FusePass()(graph) also lowers the op (passes/lower.py): on CPU to the reference's
        ATen ops, which Inductor compiles; the graph keeps no fusepass call."""
        p = make_block_problem(M, N, K, bias_dtype=torch.float32)
        args = (p.a, p.scale_a, p.b.t(), p.scale_b.t(), p.bias)
        seen = []

        def on_graph(gm):
            FusePass()(gm.graph)
            seen.append({str(n.target) for n in gm.graph.nodes})

        torch._dynamo.reset()
        out = torch.compile(dequant_linear, backend=capture_backend(on_graph), fullgraph=True)(*args)
        self.assertIn("aten.mm.default", seen[0])  # one per 128-wide group of K
        self.assertFalse(any("fusepass" in t for t in seen[0]))
        assert_policy(out, dequant_linear(*args), block_oracle(p)[0])


def functional(a, b, sa, sb, bias):
    return F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128, output_dtype=BF16)


V2 = pytest.mark.skipif(not hasattr(F, "scaled_mm"), reason="torch.nn.functional.scaled_mm is torch >= 2.12")


def test_fusepass_backend_compiles_it_on_cpu():
    """Through Inductor for real (C++ on CPU: ~10 s): the lowered reference compiles and runs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters["fusepass"].clear()
    p = make_block_problem(M, N, K, bias_dtype=torch.float32, seed=2)
    args = (p.a, p.scale_a, p.b.t(), p.scale_b.t(), p.bias)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(dequant_linear, backend="fusepass")(*args)
    assert counters["fusepass"] == {"dequant_mm_blockwise": 1}
    assert_policy(out, dequant_linear(*args), block_oracle(p)[0])


@pytest.mark.parametrize("fn", [scaled, pytest.param(functional, marks=V2)], ids=["_scaled_mm", "F.scaled_mm"])
@pytest.mark.parametrize("m,k,fused", [(8, 512, True), (64, 512, True), (80, 512, False), (80, 256, "_scaled_mm")])
def test_fp8_rule_on_cuda(fn, m, k, fused):
    """A fake CUDA graph (traced without a GPU) in the layouts cuBLAS takes (M-major scale_a;
    F.scaled_mm's scale_b padded to 4 K blocks): fused at M <= 64, kept on cuBLAS above, but
    for a _scaled_mm with K blocks not a multiple of 4 (2 here), which cuBLAS gets wrong."""
    fused = fused is True or fused == ("_scaled_mm" if fn is scaled else "F.scaled_mm")
    kb, nb = k // 128, 2
    with FakeTensorMode():
        cuda = dict(device="cuda")
        args = (torch.empty(m, k, dtype=torch.float8_e4m3fn, **cuda),
                torch.empty(256, k, dtype=torch.float8_e4m3fn, **cuda).t(),
                torch.empty(kb, m, **cuda).t(), torch.empty(nb, -(-kb // 4) * 4 if fn is functional else kb, **cuda).t(), None)
        gm = make_fx(fn, select_decomp_table(), tracing_mode="fake")(*args)
    (d,) = FusePass().run(gm.graph)
    assert d.fused == fused and d.op == ("fusepass.scaled_mm_blockwise" if fused else None)
    if fused:
        (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusepass.scaled_mm_blockwise.default]
        assert op.meta["val"].device.type == "cuda" and tuple(op.args[3].meta["val"].shape) == (kb, nb)
    else:
        assert "kept on cuBLAS, which is faster than the fused kernel above M = 64" in d.reason


# --- must not fuse ---------------------------------------------------------------------------

_p = make_block_problem(M, N, K, seed=7)
X, SX, W, SW = _p.a, _p.scale_a, _p.b.t(), _p.scale_b.t()  # [8, 300], [8, 3], [200, 300], [2, 3]


SX64, SW_COL = torch.rand(M, 5), torch.rand(N, 3)  # groups of 64 along K = 300; 1x128 weight groups


def block_of_64(x, sx, w, sw):
    xd = x.to(BF16) * SX64.repeat_interleave(64, 1)[:, :K]
    return F.linear(xd, w.to(BF16) * sw.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K])


def activation_scale_shared_by_rows(x, sx, w, sw):  # one scale per 128 rows and 128 of K
    return dequant_linear(x, sx[:1].expand(M, -1), w, sw, None)


def weight_scale_per_channel(x, sx, w, sw):
    return F.linear(x.to(BF16) * sx.repeat_interleave(128, 1)[:, :K], w.to(BF16) * SW_COL.repeat_interleave(128, 1)[:, :K])


def weight_scale_tiled(x, sx, w, sw):  # repeat (tiles the scale) where repeat_interleave was meant
    return F.linear(x.to(BF16) * sx.repeat_interleave(128, 1)[:, :K], w.to(BF16) * sw.repeat(128, 128)[:N, :K])


def too_many_groups(x, sx, w, sw):  # 4 scale groups over K = 300
    sx4 = torch.cat([sx, sx[:, :1]], dim=1)
    return dequant_linear(x, sx4, w, sw, None)


def dequantized_weight_has_another_user(x, sx, w, sw):
    wd = w.to(BF16) * sw.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return F.linear(x.to(BF16) * sx.repeat_interleave(128, 1)[:, :K], wd), wd.sum()


def int8_operands(x, sx, w, sw):
    return dequant_linear(x.to(torch.float32).to(torch.int8), sx, w.to(torch.float32).to(torch.int8), sw, None)


CASES = [
    (block_of_64, r"\(a float32\[8, 5\] tensor\) is in 5 groups of 64 along K"),
    (activation_scale_shared_by_rows, "is shared by several rows; block-wise activation scales are per row"),
    (weight_scale_per_channel, r"is per output channel within a block \(1x128 weight groups\)"),
    (weight_scale_tiled, "repeats in another pattern than 128-wide groups along K"),
    (too_many_groups, "is in 4 groups of 128 along K"),
    (dequantized_weight_has_another_user, r"the dequantized weight \(a float32\[200, 300\] tensor\) has 2 users"),
    (int8_operands, "block-wise scales on torch.int8 operands; the block-wise op takes float8_e4m3fn"),
]


@pytest.mark.parametrize("fn,reason", CASES, ids=[c[0].__name__ for c in CASES])
def test_left_unchanged(fn, reason):
    r = run_pass(fn, X, SX, W, SW)
    assert r.counts == {} and r.after == r.before
    (d,) = r.decisions
    assert not d.fused and re.search(reason, d.reason), d.reason
    torch.testing.assert_close(r.out, fn(X, SX, W, SW))


def test_transposed_activation_is_left_unchanged():
    """An activation dequantized as [K, M] and read through ``.t()``: the op takes [M, K], so
    the pass must not hand it the untransposed data (at M == K the shapes would not tell)."""
    p = make_block_problem(256, 256, 256, seed=3)
    xt, sxt = p.a.t().contiguous(), p.scale_a.t().contiguous()  # [K, M], [ceil(K/128), M]

    def f(xt, sxt, w, sw):
        xdt = xt.to(torch.float32) * sxt.repeat_interleave(128, 0)
        return xdt.t() @ (w.to(torch.float32) * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()

    r = run_pass(f, xt, sxt, p.b.t(), p.scale_b.t())
    assert r.counts == {} and r.after == r.before
    (d,) = r.decisions
    assert not d.fused and "the dequantized activation is transposed" in d.reason, d.reason
    torch.testing.assert_close(r.out, f(xt, sxt, p.b.t(), p.scale_b.t()))


def test_symbolic_k_is_left_with_its_reason():
    """The reference form compiled with every size dynamic (its ``[..., :k]`` slices then end at
    size nodes): left as it is, with the reason, not a failed compile."""
    p = make_block_problem(M, N, K)
    r = run_pass(dequant_linear, p.a, p.scale_a, p.b.t(), p.scale_b.t(), None, dynamic=True)
    (d,) = r.decisions
    assert r.counts == {} and not d.fused and "a block-wise matmul with a symbolic K or N" in d.reason, d.reason
