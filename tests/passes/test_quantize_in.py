"""passes/quantize_in.py (``PassConfig.quantize_in_gemv``; by default where the launches run
outside CUDA graphs): at M = 1 an int8 or fp8 activation from attention, or a gated MLP's
SiLU-mul, quantized inside its matmul's launch (``fusepass.scaled_mm_dynamic``); other
activations, other M, rows used twice, other recipes: not."""

import re

import expecttest
import torch

from fusepass.ops.dynamic import quantize_rows
from fusepass.passes import PassConfig
from fusepass.passes.quantize_in import NAME
from fusepass.backend import capture_backend
from tests.support.helpers import DIVISOR
from tests.passes.harness import assert_policy, run_pass

F = torch.nn.functional
EPS = torch.finfo(torch.float32).eps
F8 = torch.float8_e4m3fn
ON, OFF = PassConfig(quantize_in_gemv=True), PassConfig(quantize_in_gemv=False)
H, D, N = 4, 32, 96  # heads, head size (K = 128), the weight's rows


def _attention_then_linear(q, k, v, w, sw, dtype=torch.int8, divisor=127.5, twice=False):
    """transformers' SDPA output, reshaped to rows, quantized per token, then a dequantized
    product (what a prepared o_proj traces)."""
    o = F.scaled_dot_product_attention(q, k, v)  # (B, H, S, D)
    x = o.transpose(1, 2).reshape(-1, H * D)
    qx, s = quantize_rows(x, dtype, divisor, EPS)
    y = ((qx.float() * s) @ (w.float() * sw).t()).to(torch.bfloat16)
    return (y, qx) if twice else y


def _inputs(rows=1, dtype=torch.int8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, generator=g, dtype=torch.bfloat16) for n in (rows, 8, 8))
    w = torch.randint(-127, 128, (N, H * D), generator=g).to(dtype)
    sw = torch.rand(N, 1, generator=g) * 0.01
    return q, k, v, w, sw


def _reference(q, k, v, w, sw, dtype=torch.int8, divisor=127.5):
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, H * D)
    qx, s = quantize_rows(o, dtype, divisor, EPS)
    return (qx.double() * s.double()) @ (w.double() * sw.double()).t()


class TestQuantizeIn(expecttest.TestCase):
    def test_attention_output_at_one_row_is_quantized_in_the_matmul(self):
        args = _inputs()
        r = run_pass(_attention_then_linear, *args, config=ON)
        self.assertEqual(r.counts, {"dequant_mm": 1, NAME: 1})
        assert_policy(r.out, _attention_then_linear(*args), _reference(*args))
        calls = [line for line in r.after.splitlines() if "fusepass." in line]
        self.assertEqual(len(calls), 1)
        self.assertRegex(calls[0], r"= fusepass\.scaled_mm_dynamic\(view, \w+, \w+, bf16, None, 127\.5, 1\.1920928955078125e-07\)")
        self.assertNotIn("amax", r.after)

    def test_by_default_only_outside_cuda_graphs(self):
        """The default (None) quantizes in the launch where the launches run outside CUDA graphs
        (a step bound by its launches); where Inductor's CUDA graphs hold them, or the caller
        captures the code itself, the row keeps its kernel (each program reads it twice more)."""
        args = _inputs()
        self.assertEqual(run_pass(_attention_then_linear, *args).counts, {"dequant_mm": 1, NAME: 1})
        with torch._inductor.config.patch({"triton.cudagraphs": True}):
            self.assertEqual(run_pass(_attention_then_linear, *args).counts, {"dequant_mm": 1})
        with torch._inductor.config.patch({"triton.cudagraphs": True}):  # (forced on)
            self.assertEqual(run_pass(_attention_then_linear, *args, config=ON).counts, {"dequant_mm": 1, NAME: 1})
        r = run_pass(_attention_then_linear, *args, config=PassConfig(split_k_outside_cuda_graphs=True))
        self.assertEqual(r.counts, {"dequant_mm": 1})

    def test_other_rows_and_the_config_leave_the_quantization_alone(self):
        for rows, config in ((2, ON), (1, PassConfig(quantize_in_gemv=False))):
            with self.subTest(rows=rows):
                args = _inputs(rows)
                r = run_pass(_attention_then_linear, *args, config=config)
                self.assertEqual(r.counts, {"dequant_mm": 1})
                self.assertIn("fusepass.scaled_mm(", r.after)

    def test_a_quantized_row_used_twice_or_a_row_from_an_input_stays(self):
        args = _inputs()
        r = run_pass(lambda *a: _attention_then_linear(*a, twice=True), *args, config=ON)
        self.assertEqual(r.counts, {"dequant_mm": 1})

        def from_input(x, w, sw):
            qx, s = quantize_rows(x, torch.int8, 127.5, EPS)
            return ((qx.float() * s) @ (w.float() * sw).t()).to(torch.bfloat16)

        x = torch.randn(1, H * D, dtype=torch.bfloat16)
        r = run_pass(from_input, x, args[3], args[4], config=ON)
        self.assertEqual(r.counts, {"dequant_mm": 1})  # (its producer's kernel can quantize it)

    def test_another_recipe_stays(self):
        """A clamp to [-127, 127], a scale_a that is not the rows' scale, a negative floor (which
        the op refuses: the compile must not fail on it)."""
        def recipe(x, w, sw, lo=-128, factor=1.0, floor=EPS):
            s = (x.float().abs().amax(-1, keepdim=True) / 127.5).clamp(min=floor)
            qx = (x.float() / s).round().clamp(lo, 127).to(torch.int8)
            return ((qx.float() * (s * factor)) @ (w.float() * sw).t()).to(torch.bfloat16)

        self._recipes_stay(recipe, (dict(lo=-127), dict(factor=2.0), dict(floor=-1.0)))

    def _recipes_stay(self, recipe, cases, dtype=torch.int8):
        """``recipe(attention's rows, w, sw, **kw)`` for each ``kw`` in ``cases``: not rewritten."""
        q, k, v, w, sw = _inputs(dtype=dtype)
        for kw in cases:
            with self.subTest(**{k: str(v) for k, v in kw.items()}):
                def f(q, k, v, w, sw, kw=kw):
                    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, H * D)
                    return recipe(o, w, sw, **kw)
                r = run_pass(f, q, k, v, w, sw, config=ON)
                self.assertNotIn(NAME, r.counts)

    def test_an_fp8_row_is_quantized_in_the_matmul(self):
        args = _inputs(dtype=F8)
        fn = lambda *a: _attention_then_linear(*a, dtype=F8, divisor=448.0)  # noqa: E731
        r = run_pass(fn, *args, config=ON)
        self.assertEqual(r.counts, {"dequant_mm": 1, NAME: 1})
        self.assertRegex(r.after, r"= fusepass\.scaled_mm_dynamic\(view, \w+, \w+, bf16, None, 448\.0, 1\.1920928955078125e-07\)")
        assert_policy(r.out, fn(*args), _reference(*args, dtype=F8, divisor=448.0))

    def test_another_fp8_recipe_stays(self):
        """Clamped to e4m3fnuz's 240; the scale in int8's order (``clamp_min(amax / D, F)``)."""
        def recipe(x, w, sw, bound=448.0, int8_order=False):
            amax = x.float().abs().amax(-1, keepdim=True)
            s = (amax / 448.0).clamp(min=EPS) if int8_order else amax.clamp(min=EPS) / 448.0
            qx = (x.float() / s).clamp(-bound, bound).to(F8)
            return ((qx.float() * s) @ (w.float() * sw).t()).to(torch.bfloat16)

        self._recipes_stay(recipe, (dict(bound=240.0), dict(int8_order=True)), F8)


def _gated_mlp(g, u, w, sw, act=F.silu, swap=False, twice=False):
    """A gated MLP's down projection as a prepared model traces it: ``act(gate) * up``, as
    rows, quantized per token (to ``w``'s dtype), then a dequantized product."""
    h = u * act(g) if swap else act(g) * u  # (B, S, K)
    x = h.reshape(-1, h.shape[-1])
    qx, s = quantize_rows(x, w.dtype, DIVISOR[w.dtype], EPS)
    y = ((qx.float() * s) @ (w.float() * sw).t()).to(torch.bfloat16)
    return (y, h) if twice else y


def _gated_inputs(dtype=torch.bfloat16, seq=1, seed=0, K=160, w_dtype=torch.int8):
    g = torch.Generator().manual_seed(seed)
    gate, up = ((torch.randn(1, seq, K, generator=g) * 3).to(dtype) for _ in range(2))
    w = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
    if w_dtype != torch.int8:
        w = (w.float() * 3.5).to(w_dtype)
    return gate, up, w, torch.rand(N, 1, generator=g) * 0.01


def _gated_reference(g, u, w, sw):
    x = (F.silu(g) * u).reshape(-1, g.shape[-1])
    qx, s = quantize_rows(x, w.dtype, DIVISOR[w.dtype], EPS)
    return (qx.double() * s.double()) @ (w.double() * sw.double()).t()


class TestGatedRow(expecttest.TestCase):
    def test_silu_mul_at_one_row_is_gated_and_quantized_in_the_matmul(self):
        for dtype, swap, w_dtype in ((torch.bfloat16, False, torch.int8), (torch.bfloat16, True, torch.int8),
                                     (torch.float16, False, torch.int8), (torch.float32, False, torch.int8),
                                     (torch.bfloat16, False, F8)):
            with self.subTest(dtype=str(dtype), swap=swap, w=str(w_dtype)):
                args = _gated_inputs(dtype, w_dtype=w_dtype)
                fn = lambda *a: _gated_mlp(*a, swap=swap)  # noqa: E731
                r = run_pass(fn, *args, config=ON)
                self.assertEqual(r.counts, {"dequant_mm": 1, NAME: 1})
                calls = [line for line in r.after.splitlines() if "fusepass." in line]
                self.assertEqual(len(calls), 1)
                # (up as x, gate last; each reshaped to the quantized rows' [1, K])
                self.assertRegex(calls[0], r"= fusepass\.scaled_mm_dynamic\((\w+), \w+, \w+, bf16, None, "
                                           r"(127\.5|448\.0), 1\.1920928955078125e-07, (\w+)\)")
                self.assertNotIn("exp", r.after)
                self.assertNotIn("amax", r.after)
                assert_policy(r.out, fn(*args), _gated_reference(*args))
                # CPU: the op computes the gated row with eager's ops: the unfused graph's numbers
                self.assertTrue(torch.equal(r.out, fn(*args)))

    def test_the_gate_and_up_rows_in_their_op_order(self):
        g, u, w, sw = _gated_inputs()
        r = run_pass(_gated_mlp, g, u, w, sw, config=ON)
        x, gate = (re.search(r"scaled_mm_dynamic\((\w+), .*, (\w+)\)$", r.after, re.M).groups())
        self.assertIn(f"{x}: bf16[1, 160] = aten.reshape(u, [1, 160])", r.after)
        self.assertIn(f"{gate}: bf16[1, 160] = aten.reshape(g, [1, 160])", r.after)

    def test_by_default_only_outside_cuda_graphs(self):
        args = _gated_inputs()
        self.assertEqual(run_pass(_gated_mlp, *args).counts, {"dequant_mm": 1, NAME: 1})
        with torch._inductor.config.patch({"triton.cudagraphs": True}):
            self.assertEqual(run_pass(_gated_mlp, *args).counts, {"dequant_mm": 1})

    def test_rows_the_product_used_elsewhere_or_another_activation_stay(self):
        """Two rows; the product also returned (its kernel runs anyway); GELU (exact, tanh); no
        activation; a SiLU written by hand in bf16 (no fp32 between its ops: the kernel's would
        round otherwise); ``g * sigmoid(g)``; the SiLU in fp32 times a bf16 up (an fp32 product);
        a fp16 gate times a bf16 up; a gate broadcast along K."""
        def bf16_silu(t):
            return t / (1 + torch.exp(-t))

        def silu_with_alpha(t):  # (SiLU's graph but for the add's alpha)
            f = t.float()
            return (f / torch.add(torch.exp(-f), 1, alpha=2)).to(t.dtype)

        cases = {
            "two rows": (_gated_mlp, _gated_inputs(seq=2)),
            "product used twice": (lambda *a: _gated_mlp(*a, twice=True), _gated_inputs()),
            "gelu": (lambda *a: _gated_mlp(*a, act=F.gelu), _gated_inputs()),
            "gelu tanh": (lambda *a: _gated_mlp(*a, act=lambda t: F.gelu(t, approximate="tanh")), _gated_inputs()),
            "no activation": (lambda *a: _gated_mlp(*a, act=lambda t: t), _gated_inputs()),
            "bf16 silu by hand": (lambda *a: _gated_mlp(*a, act=bf16_silu), _gated_inputs()),
            "g * sigmoid(g)": (lambda *a: _gated_mlp(*a, act=lambda t: t * torch.sigmoid(t)), _gated_inputs()),
            "fp32 silu": (lambda *a: _gated_mlp(*a, act=lambda t: F.silu(t.float())), _gated_inputs()),
            "fp16 gate": (lambda g, *a: _gated_mlp(g.half(), *a), _gated_inputs()),
            "broadcast gate": (lambda *a: _gated_mlp(*a, act=lambda t: F.silu(t[..., :1])), _gated_inputs()),
            "add with alpha": (lambda *a: _gated_mlp(*a, act=silu_with_alpha), _gated_inputs()),
        }
        for name, (fn, args) in cases.items():
            with self.subTest(name):
                r = run_pass(fn, *args, config=ON)
                self.assertEqual(r.counts, {"dequant_mm": 1})
                self.assertIn("fusepass.scaled_mm(", r.after)

    def test_a_silu_used_elsewhere_is_still_gated_in_the_matmul(self):
        """(Its own kernel computes it again for the other use.)"""
        def fn(g, u, w, sw):
            return _gated_mlp(g, u, w, sw), F.silu(g)

        args = _gated_inputs()
        r = run_pass(fn, *args, config=ON)
        self.assertEqual(r.counts, {"dequant_mm": 1, NAME: 1})
        self.assertTrue(torch.equal(r.out[0], fn(*args)[0]))

    def test_a_symbolic_factor_or_a_symbolic_k_compiles_unchanged(self):
        """A product of the SiLU and a size (a SymInt's node, not a tensor); a K that is
        symbolic (the op's rows would be reshaped to it). Neither fails the compile."""
        def by_size(g, n, w, sw):
            h = F.silu(g) * n.shape[0]
            qx, s = quantize_rows(h.reshape(-1, h.shape[-1]), torch.int8, 127.5, EPS)
            return ((qx.float() * s) @ (w.float() * sw).t()).to(torch.bfloat16)

        g, _, w, sw = _gated_inputs()
        n = torch.zeros(5)
        torch._dynamo.mark_dynamic(n, 0)
        r = run_pass(by_size, g, n, w, sw, config=ON)
        self.assertEqual(r.counts, {"dequant_mm": 1})
        g, u, w, sw = _gated_inputs()
        for t, dim in ((g, 2), (u, 2), (w, 1)):  # (K alone: a symbolic divisor would not match anyway)
            torch._dynamo.mark_dynamic(t, dim)
        r = run_pass(_gated_mlp, g, u, w, sw, config=ON)
        self.assertNotIn(NAME, r.counts)
        self.assertRegex(r.before, r"bf16\[1, 1, S\d\]")  # (K symbolic in the graph)
        self.assertEqual(r.out.shape, (1, N))


def _handwritten_rows(x, w, sw, dtype=torch.int8, divisor=127.0, clamp=True, bf16_scale=False, floor=1e-8):
    """A hand-written linear's quantization (``fusepass.demo.handwritten``): the amax in the
    row's dtype then cast, the floor before the division; fp8 with no clamp before the cast."""
    amax = x.abs().amax(1, keepdim=True)
    s = amax.clamp(min=floor) / divisor if bf16_scale else amax.float().clamp(min=floor) / divisor
    v = x / s
    if dtype == torch.int8:
        q = v.round().clamp(-128, 127).to(torch.int8)
    else:
        q = (v.clamp(-448.0, 448.0) if clamp else v).to(F8)
    return ((q.float() * s.float()) @ (w.float() * sw).t()).to(torch.bfloat16)


class TestHandWrittenRecipes(expecttest.TestCase):
    def _attention_then(self, recipe, dtype, **kw):
        q, k, v, w, sw = _inputs(dtype=dtype)

        def f(q, k, v, w, sw):
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, H * D)
            return recipe(o, w, sw, dtype=dtype, **kw)

        on = run_pass(f, q, k, v, w, sw, config=ON)
        counts = on.counts  # (read before the next run clears them)
        return on, counts, run_pass(f, q, k, v, w, sw, config=OFF)

    def test_int8_with_the_floor_first_is_quantized_in_the_matmul(self):
        on, counts, off = self._attention_then(_handwritten_rows, torch.int8)
        self.assertEqual(counts, {"dequant_mm": 1, NAME: 1})
        self.assertRegex(on.after, r"= fusepass\.scaled_mm_dynamic\(view, \w+, \w+, bf16, None, 127\.0, 1e-08, None, True\)")
        self.assertTrue(torch.equal(on.out, off.out))  # (the CPU: the op's ATen recipe, the same values)

    def test_fp8_unclamped_is_quantized_in_the_matmul(self):
        """``x / s`` with ``s = max(amax, F) / 448``: never past 448 by more than a rounding, so
        the cast's values are the clamped ones (e4m3 rounds up to 464 to 448)."""
        for clamp in (False, True):
            with self.subTest(clamp=clamp):
                on, counts, off = self._attention_then(_handwritten_rows, F8, divisor=448.0, clamp=clamp)
                self.assertEqual(counts, {"dequant_mm": 1, NAME: 1})
                self.assertRegex(on.after, r"= fusepass\.scaled_mm_dynamic\(view, \w+, \w+, bf16, None, 448\.0, 1e-08\)")
                self.assertTrue(torch.equal(on.out, off.out))

    def test_a_scale_in_bf16_or_an_unclamped_fp8_row_past_448_stays(self):
        """(and an unclamped fp8 row whose scale could be subnormal: no floor)"""
        for dtype, kw in ((torch.int8, dict(bf16_scale=True)), (F8, dict(divisor=500.0, clamp=False)),
                          (F8, dict(divisor=448.0, clamp=False, floor=0.0))):
            with self.subTest(dtype=str(dtype), **{k: str(v) for k, v in kw.items()}):
                _, counts, _ = self._attention_then(_handwritten_rows, dtype, **kw)
                self.assertNotIn(NAME, counts)

    def test_a_handwritten_llama_at_decode_b1_quantizes_o_proj_and_down_proj_rows_in_their_launches(self):
        transformers = __import__("pytest").importorskip("transformers")  # noqa: F841
        from fusepass.demo import models
        from fusepass.passes import FusePass

        sizes = models.Sizes(layers=2, hidden_size=128, intermediate_size=256, heads=4, kv_heads=2, vocab_size=512)
        model = models.quantized_copy(models.random_llama(sizes, 64, torch.device("cpu"), seed=0), "int8", "handwritten")
        ids = models.prompt(model, 1, 8, seed=2)
        outs, counts = [], []
        for config in (ON, OFF):
            pass_ = FusePass(config)
            torch._dynamo.utils.counters["fusepass"].clear()
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=capture_backend(lambda gm: pass_.run(gm.graph)), dynamic=False)
            with torch.no_grad():
                outs.append(compiled(**models.decode_inputs(ids, models.static_cache(model, 1, 16))).logits)
            counts.append(dict(torch._dynamo.utils.counters["fusepass"]))
        self.assertEqual(counts[0].pop(NAME), 2 * sizes.layers)
        self.assertEqual(counts[0], counts[1])
        self.assertTrue(torch.equal(outs[0], outs[1]))
