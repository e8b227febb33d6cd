"""``fusepass.quantize_experts`` and ``W8A8Experts``: a float MoE model's experts (transformers'
Qwen3-MoE, Mixtral and OLMoE, tiny, built by transformers) as int8 / fp8 weights per channel with
per-token activations, run on ``fusepass.scaled_grouped_mm``: every experts module converted, the
module's output its quantized values' (a float64 simulation), the model's logits near bf16's,
compiled as eager, and what it cannot take left with the reason."""

import pytest
import torch
from torch import nn

import fusepass
from fusepass.integrations.experts import W8A8Experts, quantize_experts
from fusepass.integrations.linear import Act, quantize_input

ARCHS = ("qwen3_moe", "mixtral", "olmoe")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=64)


def moe_model(arch: str, seed: int = 0, blocks: bool = False):
    """A tiny MoE model of transformers' ``arch``; ``blocks``: every linear and expert whole 128x128
    blocks (hidden 256, head_dim 128, expert width 256), as native FP8's block scales need: two blocks
    along each of an expert's dimensions (transformers 5.17 saves a scale of one block along one as a
    vector and loads it back flattened)."""
    import transformers

    torch.manual_seed(seed)
    sizes = {**COMMON, **(dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1) if blocks else {})}
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**sizes, moe_intermediate_size=256 if blocks else 64, num_experts=16,
                                             num_experts_per_tok=4, head_dim=128 if blocks else 32)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**sizes, num_local_experts=8, num_experts_per_tok=2)
    else:
        config = transformers.OlmoeConfig(**sizes, num_experts=16, num_experts_per_tok=4, eos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    for m in model.modules():  # a trained model's scale: unit-variance activations through each expert
        for name in ("gate_up_proj", "down_proj"):
            t = getattr(m, name, None)
            if isinstance(t, nn.Parameter) and t.dim() == 3:
                nn.init.normal_(t, std=t.shape[-1] ** -0.5)
    return model


def _experts(model):
    return [m for m in model.modules() if isinstance(m, W8A8Experts)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_experts_module_is_converted_and_the_logits_stay_near_bf16(arch):
    model = moe_model(arch)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.float()
        report = quantize_experts(model, "int8")
        out = model(ids).logits.float()
    assert report.converted == [f"model.layers.{i}.mlp.experts" for i in range(2)] and not report.left
    assert len(_experts(model)) == 2 and str(report).startswith("fusepass.quantize_experts: 2 experts modules converted")
    assert torch.isfinite(out).all()
    # W8A8's error, through two random layers whose routing it can flip (a top-k choice is not
    # continuous): 3-23% here; each row sent to the next expert instead gave 124-135%.
    assert ((out - ref).norm() / ref.norm()).item() < 0.5


def _dequantized(q: torch.Tensor, scale: torch.Tensor, blocks: bool) -> torch.Tensor:
    """Values times their scales in float64: experts' [E, N, K] per row ([E, N]) or per 128x128
    block ([E, N/128, K/128]); rows [T, K] per row ([T, 1]) or per 1x128 group ([T, K/128])."""
    s = scale.double()
    if blocks:
        if q.dim() == 3:
            s = s.repeat_interleave(128, 1)[:, : q.shape[1]]
        return q.double() * s.repeat_interleave(128, -1)[..., : q.shape[-1]]
    return q.double() * (s[..., None] if q.dim() == 3 else s.reshape(q.shape[0], 1))


def _simulated(module: W8A8Experts, x, index, weights):
    """The module's output in float64 from its own quantized values: each routed row's dequantized
    product, the gated row (bf16, as the op returns it) quantized again, weighted and added."""
    act = module.act
    blocks = act.kind == "fp8-block"
    qa, sa, _ = quantize_input(x, act)
    gate_up = _dequantized(module.gate_up, module.gate_up_scale, blocks)
    down = _dequantized(module.down, module.down_scale, blocks)
    out = torch.zeros(x.shape[0], module.hidden_dim, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gu = _dequantized(qa[t:t + 1], sa[t:t + 1], blocks)[0] @ gate_up[e].t()
            g, u = gu.to(x.dtype).chunk(2)
            qh, sh, _ = quantize_input(module.act_fn(g)[None] * u[None], act)
            out[t] += (_dequantized(qh, sh, blocks)[0] @ down[e].t()) * weights[t, j].double()
    return out


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block"])
def test_the_module_computes_its_quantized_values(kind):
    model = moe_model("qwen3_moe", blocks=kind == "fp8-block")
    quantize_experts(model, kind)
    module = _experts(model)[0]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, module.hidden_dim, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(5)])
    weights = torch.softmax(torch.randn(5, 4, generator=g), -1)
    with torch.no_grad():
        out = module(x, index, weights)
    want = _simulated(module, x, index, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (5, module.hidden_dim)
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2  # (bf16 roundings of the rows)
    assert module.gate_up.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    if kind == "fp8-block":  # one scale per 128x128 block, the largest value of each block at +-448
        E, N, K = module.gate_up.shape
        assert module.gate_up_scale.shape == (E, N // 128, K // 128)
        blocks = module.gate_up.float().reshape(E, N // 128, 128, K // 128, 128).abs().amax(dim=(2, 4))
        assert (blocks == 448).all()


def test_fp8_block_needs_whole_blocks():
    model = moe_model("qwen3_moe")  # (experts 64 wide)
    report = quantize_experts(model, "fp8-block")
    assert not report.converted and report.left["model.layers.0.mlp.experts"] == (
        "fp8-block needs experts of whole 128x128 blocks; gate_up_proj is (16, 128, 128), down_proj (16, 128, 64)")


def _routed_inputs(T: int, H: int, E: int, k: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    return x.to(device), index.to(device), weights.to(device)


# (on a GPU: the row kernel's M and the blocks' (4 and 48 rows); fp8-block: native FP8's experts)
@pytest.mark.parametrize("kind,tokens", [("int8", 1), ("fp8-block", 12)])
def test_compiled_with_fusepass_as_eager(kind, tokens):
    model = moe_model("qwen3_moe", blocks=kind == "fp8-block").to(DEVICE)
    quantize_experts(model, kind)
    module = _experts(model)[0]
    inputs = _routed_inputs(tokens, module.hidden_dim, 16, 4, seed=tokens, device=DEVICE)
    torch._dynamo.reset()
    with torch.no_grad():
        want = module(*inputs)
        got = torch.compile(module, backend="fusepass", dynamic=False, fullgraph=True)(*inputs)
    # (a compiled quantization may round a value the other way: one int8 step of a row)
    assert got.dtype == want.dtype and ((got.double() - want.double()).norm() / want.double().norm()).item() < 1e-2


def test_a_model_with_converted_experts_compiles_as_one_graph():
    model = moe_model("qwen3_moe").to(DEVICE)
    quantize_experts(model, "int8")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(ids).logits.float()
        got = torch.compile(model, backend="fusepass", dynamic=False, fullgraph=True)(ids).logits.float()
    # Loose: the router's compiled bf16 logits can pick another expert for a token near a tie
    # (one token of 6 with the GPU machine's torch 2.11); the experts' own numerics are the test above.
    assert torch.isfinite(got).all() and ((got - want).norm() / want.norm()).item() < 0.25


class _Experts(nn.Module):
    """transformers-like experts (as if of transformers' own classes) with flags of its own."""

    def __init__(self, **flags):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 8))
        self.act_fn = nn.SiLU()
        self.__dict__.update(flags)


_Experts.__module__ = "transformers.models.fake"


class _CustomGate(_Experts):
    def _apply_gate(self, gate_up):
        return gate_up


_CustomGate.__module__ = _Experts.__module__


class _Users(_Experts):
    pass


_Users.__module__ = __name__  # (a user's own class)


def _hooked():
    m = _Experts()
    m.register_forward_hook(lambda *args: None)
    return m


def _wrapped():
    m = _Experts()
    m.forward = lambda *args: None
    return m


@pytest.mark.parametrize("module,why", [
    (_Experts(has_bias=True), "has_bias=True experts are not supported"),
    (_Experts(is_transposed=True), "is_transposed=True experts are not supported"),
    (_CustomGate(), "a custom gate (_CustomGate._apply_gate) is not supported"),
    (_Users(), f"a {__name__}._Users (not one of transformers' experts classes)"),
    (_hooked(), "it has forward hooks, which W8A8Experts would not run"),
    (_wrapped(), "its forward is replaced on the instance"),
], ids=["bias", "transposed", "gate", "class", "hooks", "forward"])
def test_what_it_cannot_take_is_left_with_the_reason(module, why):
    model = nn.Sequential(module)
    report = quantize_experts(model)
    assert report.converted == [] and report.left["0"].startswith(why)
    assert model[0] is module


def test_a_bad_kind_is_an_error():
    with pytest.raises(ValueError, match="fusepass.quantize_experts: kind must be one of int8, fp8, fp8-block; got 'int4'"):
        quantize_experts(nn.Linear(2, 2), "int4")


def test_the_act_is_the_kinds():
    model = moe_model("mixtral")
    quantize_experts(model, "fp8")
    assert {m.act for m in _experts(model)} == {Act("fp8")}
    assert "act=fp8" in repr(_experts(model)[0]) and fusepass.W8A8Experts is W8A8Experts


def test_dtype_casts_leave_the_quantized_values_and_device_moves_carry_them():
    model = moe_model("qwen3_moe")
    quantize_experts(model, "fp8")
    module = _experts(model)[0]
    model.half()
    assert (module.gate_up.dtype, module.gate_up_scale.dtype) == (torch.float8_e4m3fn, torch.float32)
    model.to("meta")
    assert module.down.device.type == "meta" and module.down.dtype == torch.float8_e4m3fn


def test_the_state_dict_loads_into_another_quantized_copy():
    a, b = moe_model("mixtral", seed=0), moe_model("mixtral", seed=1)
    quantize_experts(a, "int8"), quantize_experts(b, "int8")
    state = a.state_dict()
    assert "model.layers.0.mlp.experts.gate_up" in state and "model.layers.0.mlp.experts.gate_up_proj" not in state
    b.load_state_dict(state)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, rtol=0, atol=0)


def test_save_pretrained_is_refused_with_the_way_out(tmp_path):
    """A checkpoint of W8A8Experts would load back as float experts with random weights."""
    model = moe_model("olmoe")
    quantize_experts(model, "int8")
    with pytest.raises(NotImplementedError, match="save the float model, and call quantize_experts after loading it"):
        model.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())


def test_explain_lists_the_experts_and_what_they_run():
    model = moe_model("qwen3_moe")
    quantize_experts(model, "int8")
    torch._dynamo.reset()
    with torch.no_grad():
        report = fusepass.explain(model, torch.randint(0, 256, (1, 4)))
    assert [path for path, _ in report.experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert ("  model.layers.1.mlp.experts: fusepass.W8A8Experts (int8, 16 experts): gate/up and down as "
            "fusepass.scaled_grouped_mm, the routing weights in down's epilogue") in str(report).splitlines()


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_token_with_an_inf_or_nan_is_nan_not_a_number(kind, bad):
    model = moe_model("qwen3_moe", blocks=kind == "fp8-block")
    quantize_experts(model, kind)
    module = _experts(model)[0]
    x, index, weights = _routed_inputs(4, module.hidden_dim, 16, 4, seed=5)
    x[2, 7] = bad
    with torch.no_grad():
        out = module(x, index, weights)
    assert out[2].isnan().all() and torch.isfinite(out[[0, 1, 3]]).all()


def test_silu_is_told_apart():
    from transformers.activations import ACT2FN

    from fusepass.integrations.experts import is_silu

    assert is_silu(ACT2FN["silu"]) and is_silu(nn.SiLU()) and is_silu(torch.nn.functional.silu)
    replaced = nn.SiLU()
    replaced.forward = torch.tanh
    assert not any(is_silu(f) for f in (ACT2FN["gelu"], lambda x: torch.nn.functional.silu(x), replaced,
                                        type("MySiLU", (nn.SiLU,), {})()))


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block"])
def test_down_quantizes_the_gated_rows_in_its_op_where_the_act_is_silu(kind, monkeypatch):
    """int8 and fp8 per row with SiLU: down is ``scaled_grouped_mm_dynamic`` of gate and up (on a
    GPU at decode its kernel computes the SiLU-mul and quantization); otherwise, and for
    fp8-block, the SiLU-mul, the quantization, then ``scaled_grouped_mm``."""
    import fusepass.integrations.experts as experts

    model = moe_model("qwen3_moe", blocks=kind == "fp8-block").to(DEVICE)
    quantize_experts(model, kind)
    module = _experts(model)[0]
    calls = []
    real = experts.scaled_grouped_mm_dynamic
    monkeypatch.setattr(experts, "scaled_grouped_mm_dynamic", lambda *a, **k: calls.append(k) or real(*a, **k))
    inputs = _routed_inputs(2, module.hidden_dim, 16, 4, seed=3, device=DEVICE)
    with torch.no_grad():
        fused = module(*inputs)
        assert len(calls) == (kind != "fp8-block")
        module.act_fn = type("MySiLU", (nn.SiLU,), {})()  # (not told SiLU: the unfused path)
        unfused = module(*inputs)
    assert len(calls) == (kind != "fp8-block")
    if DEVICE == "cpu" or kind == "fp8-block":
        assert torch.equal(fused, unfused)
    else:  # (Triton's exp in the kernel: a gated value may round to its neighbour)
        assert ((fused.double() - unfused.double()).norm() / unfused.double().norm()).item() < 1e-2


@pytest.mark.parametrize("kind", ["int8", "fp8-block"])
def test_down_writes_rows_in_the_models_dtype_and_a_tokens_rows_add_in_fp32(kind, monkeypatch):
    """Down's launch rounds each weighted row once to the hidden states' dtype (not fp32: half the
    bytes written and read again); the k rows of a token are then added in fp32 and rounded once."""
    import fusepass.integrations.experts as experts

    model = moe_model("qwen3_moe", blocks=kind == "fp8-block")
    quantize_experts(model, kind)
    module = _experts(model)[0]
    rows = []
    for name in ("scaled_grouped_mm", "scaled_grouped_mm_dynamic"):
        real = getattr(experts, name)
        monkeypatch.setattr(experts, name, lambda *a, _real=real, **k: rows.append(_real(*a, **k)) or rows[-1])
    x, index, weights = _routed_inputs(3, module.hidden_dim, 16, 4, seed=5)
    with torch.no_grad():
        out = module(x, index, weights)
    h, y = rows  # (gate/up's output, then down's)
    assert h.dtype == y.dtype == torch.bfloat16 and y.shape == (3 * 4, module.hidden_dim)
    assert torch.equal(out, y.view(3, 4, -1).float().sum(1).to(torch.bfloat16))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rows_adds_a_tokens_rows_in_fp32_and_rounds_once(dtype, traced, monkeypatch):
    """``add_rows`` in both of its forms (torch's sum eagerly; traced, the k slices added in turn,
    which Inductor reads at the read rate): a token's k rows added in fp32, rounded once. A row of
    1 and seven of 2^-9 sum to 1.0137 (bf16: 1.015625); added in bf16 each 2^-9 is lost (1.0). (fp16
    holds 1 + 2^-9 exactly, so that case tells fp32 from bf16 adding only.)"""
    from fusepass.integrations.experts import add_rows

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: traced)
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(5 * 8, 64, generator=g) * 30).to(dtype)
    y[8:16, 0] = torch.tensor([1.0] + [2.0 ** -9] * 7, dtype=dtype)
    got = add_rows(y, 8)
    exact = y.double().view(5, 8, 64).sum(1)
    assert got.dtype == dtype and got.shape == (5, 64)
    want = 1.015625 if dtype == torch.bfloat16 else 1 + 7 * 2.0 ** -9
    assert got[1, 0].item() == exact[1, 0].to(dtype).item() == want
    # (fp32 sums in another order differ by fp32's rounding, under one rounding to bf16 / fp16)
    torch.testing.assert_close(got.double(), exact, rtol=2 * torch.finfo(dtype).eps, atol=1e-4)
    assert add_rows(y[:0], 8).shape == (0, 64)


# (8 routed rows: the row kernel; 48: the blocks; a symbolic M: the prefill blocks)
@pytest.mark.parametrize("tokens,routes,dynamic", [(2, 0, False), (12, 1, False), (12, 1, True)])
def test_a_layer_sorts_its_rows_once_for_both_matmuls(tokens, routes, dynamic):
    """Where the grouped matmuls take the sorted blocks, the layer sorts its routed rows once
    (``route_experts``) and gives them to gate/up and to down; at the row kernel's rows none."""
    model = moe_model("qwen3_moe").to(DEVICE)
    quantize_experts(model, "int8")
    module = _experts(model)[0]
    inputs = _routed_inputs(tokens, module.hidden_dim, 16, 4, seed=tokens, device=DEVICE)
    graphs = []

    def record(gm, example):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    with torch.no_grad():
        want = module(*inputs)
        got = torch.compile(module, backend=record, dynamic=dynamic, fullgraph=True)(*inputs)
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "fusepass" in str(n.target)]
    found = [n for n in nodes if "route_experts" in str(n.target)]
    matmuls = [n for n in nodes if "scaled_grouped_mm" in str(n.target)]
    assert len(found) == routes and len(matmuls) == 2
    for n in matmuls:  # (each takes the one route's two tensors, or none)
        given = [v for v in (*n.args, *n.kwargs.values()) if isinstance(v, torch.fx.Node) and v.args
                 and any(v.args[0] is f for f in found)]
        assert sorted(g.args[1] for g in given) == [0, 1][:2 * routes]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
