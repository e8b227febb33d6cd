"""A prepared model behaves as the module it replaced, or ``prepare`` leaves it and says why.

- gradients: the input's (and a trainable bias's) gradient through a frozen W8A8 weight is
  the dequantized weight's, eager and compiled (``backend="fusepass"``, ``aot_eager``); the
  ops refuse a gradient at the forward;
- behaviour: ``nn.Linear`` subclasses, hooks and instance forwards are left, with the reason;
- transformers: the attributes it reads (``weight``, ``bias`` Parameters), ``state_dict`` /
  ``load_state_dict``, ``save_pretrained`` then ``from_pretrained`` (bit for bit);
- the meta device, ``to_empty``, ``share_memory``;
- edges: K past int32's exact range, an infinity in the input, an integer input, a quantized
  linear as the model itself or held under two names.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import fusepass
from fusepass.integrations.linear import Act, Joint, W8A8Linear
from fusepass.ops.checks import MAX_K_INT8

pytest.importorskip("torchao")
pytest.importorskip("transformers")
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, MappingType, quantize_  # noqa: E402

from fusepass.demo import models  # noqa: E402

TORCHAO = {"int8": lambda: Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
           "int8-asym": lambda: Int8DynamicActivationInt8WeightConfig(act_mapping_type=MappingType.ASYMMETRIC,
                                                                     set_inductor_config=False)}


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _quantized(model: nn.Module, quant: str = "int8") -> nn.Module:
    quantize_(model, TORCHAO[quant]())
    return model


# --- gradients ---------------------------------------------------------------------------


def _norm_then_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).bfloat16()


@pytest.mark.parametrize("backend", [None, "aot_eager", "fusepass"])
@pytest.mark.parametrize("quant", list(TORCHAO))
def test_a_norms_gradient_through_prepared_linears_is_the_float_models(backend, quant):
    """The issue's reproducer: a trainable LayerNorm before two frozen W8A8 linears, in
    training mode. Its weight's gradient was 3.06 relative error from the float model's
    (compiled; eager raised at ``backward()``); the quantization's own error is ~2%."""
    float_model = _norm_then_mlp()
    model = _quantized(copy.deepcopy(float_model), quant)
    fusepass.prepare(model)
    model.train()
    x = torch.randn(4, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    reference = float_model.float()
    reference(x.float()).pow(2).sum().backward()
    torch._dynamo.reset()
    run = model if backend is None else torch.compile(model, backend=backend, dynamic=False)
    run(x).float().pow(2).sum().backward()
    for ours, theirs in ((model[0].weight.grad, reference[0].weight.grad), (model[0].bias.grad, reference[0].bias.grad)):
        assert _rel(ours, theirs) < 0.05, _rel(ours, theirs)
    # the linears' biases are trainable Parameters as they were
    assert isinstance(model[1].bias, nn.Parameter) and _rel(model[1].bias.grad, reference[1].bias.grad) < 0.05


def _lone(kind: str, bias: bool = True, n: int = 256, k: int = 256) -> W8A8Linear:
    g = torch.Generator().manual_seed(0)
    if kind.startswith("fp8"):
        weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n // 128, k // 128, generator=g) if kind == "fp8-block" else torch.rand(n, generator=g)
    colsum = weight.to(torch.int32).sum(1) if kind == "int8-asym" else None
    b = nn.Parameter(torch.randn(n, generator=g)) if bias else None
    input_scale = torch.tensor(0.01) if kind == "fp8-static" else None
    return W8A8Linear(Joint(weight, scale / 100, colsum, b, input_scale), 128, 256, Act(kind))


def _dequantized(lin: W8A8Linear) -> torch.Tensor:
    w, s = lin.weight.double(), lin.weight_scale.double()
    if lin.act.kind == "fp8-block":
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return w * s
    return w * s[:, None]


@pytest.mark.parametrize("kind", Act.KINDS)
def test_input_and_bias_gradients_are_the_dequantized_weights(kind):
    """Rows [128, 256) of a joint weight: d(out)/dx = grad @ W_deq (the activation's rounding
    passed straight through), d(out)/d(bias) the grad's sum on those rows, zero on the others."""
    lin = _lone(kind)
    x = torch.randn(2, 3, 256, requires_grad=True)
    grad = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2))
    lin(x).backward(grad)
    torch.testing.assert_close(x.grad.double(), grad.double() @ _dequantized(lin), rtol=1e-5, atol=1e-4)
    bias_grad = lin.joint.bias.grad
    assert torch.equal(bias_grad[:128], torch.zeros(128))
    torch.testing.assert_close(bias_grad[128:], grad.sum((0, 1)))


def test_without_a_gradient_the_forward_is_the_same():
    lin = _lone("int8")
    x = torch.randn(3, 256)
    with torch.no_grad():
        plain = lin(x)
    assert torch.equal(lin(x.requires_grad_()).detach(), plain)


@pytest.mark.parametrize("op", ["scaled_mm", "scaled_mm_azp"])
def test_the_ops_refuse_a_gradient_at_the_forward(op):
    a, b = torch.ones(2, 4, dtype=torch.int8), torch.ones(4, 3, dtype=torch.int8)
    bias = torch.zeros(3, requires_grad=True)
    extra = (torch.zeros(3, dtype=torch.int32),) if op == "scaled_mm_azp" else ()
    with pytest.raises(RuntimeError, match=f"fusepass.{op} has no gradient.*W8A8Linear"):
        getattr(torch.ops.fusepass, op)(a, b, torch.ones(1), torch.ones(1), torch.float32, *extra, bias=bias)
    with torch.no_grad():  # (no gradient asked for: it runs)
        getattr(torch.ops.fusepass, op)(a, b, torch.ones(1), torch.ones(1), torch.float32, *extra, bias=bias)


# --- behaviour the converted module would drop -------------------------------------------


class _Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class _Marked(nn.Linear):
    pass


def _pair():
    return _quantized(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16)).bfloat16())


def test_subclasses_of_linear_are_left_with_the_reason():
    model = _quantized(nn.Sequential(_Scaled(64, 32), _Marked(32, 16), nn.Linear(16, 8)).bfloat16())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    report = fusepass.prepare(model)
    assert set(report.converted) == {"2"}
    assert "_Scaled (a subclass of nn.Linear and its own forward)" in report.left["0"]
    assert "_Marked (a subclass of nn.Linear)" in report.left["1"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0.05, atol=0.05)
    assert type(model[0]) is _Scaled and type(model[1]) is _Marked


def test_linears_with_hooks_are_left_and_their_hooks_still_run():
    model = _pair()
    model[0].register_forward_hook(lambda m, i, out: torch.zeros_like(out))
    model[1].register_forward_pre_hook(lambda m, i: None)
    report = fusepass.prepare(model)
    assert not report.converted
    assert "forward hooks" in report.left["0"] and "forward pre-hooks" in report.left["1"]
    with torch.no_grad():
        out = model(torch.randn(2, 64, dtype=torch.bfloat16))
    assert torch.equal(out, model[1](torch.zeros(2, 32, dtype=torch.bfloat16)))  # (the zeroing hook ran)


def test_a_forward_replaced_on_the_instance_is_left():
    model = _pair()
    original = model[0].forward
    model[0].forward = lambda x: original(x) * 0
    report = fusepass.prepare(model)
    assert set(report.converted) == {"1"} and "forward is replaced on the instance" in report.left["0"]


# --- what transformers reads, state dicts, save_pretrained / from_pretrained ---------------

SIZES = models.Sizes(layers=2, hidden_size=128, intermediate_size=256, heads=4, kv_heads=2, vocab_size=512)


@pytest.fixture(scope="module")
def bf16_model():
    return models.random_llama(SIZES, 64, torch.device("cpu"), seed=0)


def _prepared(bf16_model, quant="int8"):
    model = models.quantized_copy(bf16_model, quant, "torchao")
    fusepass.prepare(model)
    return model


def test_output_embeddings_weight_and_biases_as_transformers_reads_them(bf16_model):
    model = _prepared(bf16_model)
    head = model.get_output_embeddings()
    assert isinstance(head, W8A8Linear) and head.weight.shape == (SIZES.vocab_size, SIZES.hidden_size)
    assert head.weight.dtype == torch.int8 and head.weight_scale.shape == (SIZES.vocab_size,)
    # biases stay Parameters: a lone linear keeps its own, joined siblings' are one Parameter
    lone = _pair()
    bias = lone[1].bias
    fusepass.prepare(lone)
    assert lone[1].bias is bias and any(p is bias for p in lone.parameters())
    joined = nn.Module()
    joined.q, joined.k = nn.Linear(64, 32).bfloat16(), nn.Linear(64, 16).bfloat16()
    _quantized(joined)
    fusepass.prepare(joined)
    assert joined.q.joint is joined.k.joint and isinstance(joined.q.joint.bias, nn.Parameter)
    assert joined.k.bias.shape == (16,) and joined.k.bias.requires_grad


def test_state_dict_holds_each_linears_rows_once_and_loads_into_another_prepared_model(bf16_model):
    model = _prepared(bf16_model)
    state = model.state_dict()
    attn = "model.layers.0.self_attn."
    assert {f"{attn}k_proj.weight", f"{attn}k_proj.weight_scale"} <= set(state)
    assert not [k for k in state if ".joint." in k]
    assert torch.equal(state[f"{attn}k_proj.weight"], model.model.layers[0].self_attn.k_proj.weight)
    other = models.quantized_copy(models.random_llama(SIZES, 64, torch.device("cpu"), seed=7), "int8", "torchao")
    fusepass.prepare(other, join=False)  # (joined otherwise: each linear loads its own rows)
    other.load_state_dict(state)
    ids = models.prompt(bf16_model, 1, 6, seed=3)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)
    wrong = dict(state, **{f"{attn}k_proj.weight": state[f"{attn}k_proj.weight"].float()})
    with pytest.raises(RuntimeError, match="size or dtype mismatch for model.layers.0.self_attn.k_proj.weight"):
        other.load_state_dict(wrong)
    with pytest.raises(RuntimeError, match="Missing key.*k_proj.weight_scale"):
        other.load_state_dict({k: v for k, v in state.items() if k != f"{attn}k_proj.weight_scale"})


def _assert_same_state(model, loaded):
    """The same keys, dtypes and bits (fp8 compared as bytes)."""
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert list(mine) == list(theirs)
    for k, a in mine.items():
        b = theirs[k]
        assert a.dtype == b.dtype, k
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), k


@pytest.mark.parametrize("quant", list(TORCHAO))
def test_save_pretrained_then_from_pretrained_gives_the_prepared_model_bit_for_bit(bf16_model, quant, tmp_path):
    import json

    import transformers

    model = _prepared(bf16_model, quant)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fusepass" and config["schemes"][0]["kind"] == quant
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    attn = loaded.model.layers[0].self_attn
    assert isinstance(attn.q_proj, W8A8Linear) and attn.q_proj.joint is attn.v_proj.joint
    _assert_same_state(model, loaded)
    ids = models.prompt(bf16_model, 2, 8, seed=1)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_fusepass_checkpoint_loads_when_fusepass_is_imported_before_transformers(bf16_model, tmp_path):
    _prepared(bf16_model).save_pretrained(tmp_path)
    code = ("import sys, fusepass, transformers\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "print(type(m.model.layers[1].mlp.down_proj).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("W8A8Linear")


# --- meta device, to_empty, share_memory -------------------------------------------------


def test_prepare_on_the_meta_device_then_to_empty_and_load_state_dict():
    def build():
        torch.manual_seed(0)
        return _quantized(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).bfloat16())

    real = build()
    fusepass.prepare(real)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).bfloat16()
    _quantized(model)
    report = fusepass.prepare(model)
    assert set(report.converted) == {"0", "2"} and model[0].weight.is_meta
    model.to_empty(device="cpu")
    assert model[0].weight.dtype == torch.int8 and model[0].weight_scale.dtype == torch.float32
    model.load_state_dict(real.state_dict())
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), real(x))
    # loaded with assign=True straight from the meta device: made where the values are
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).bfloat16()
    _quantized(fresh)
    fusepass.prepare(fresh)
    fresh.load_state_dict(real.state_dict(), assign=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), real(x))


def test_to_meta_then_to_empty_and_share_memory_reach_every_tensor():
    model = _quantized(nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128)).bfloat16())
    fusepass.prepare(model)
    model.share_memory()
    assert all(t.is_shared() for t in [*model.buffers(), *model.parameters()])
    model.to("meta").to_empty(device="cpu")
    assert model[0].weight.device.type == "cpu" and model[0].weight.dtype == torch.int8


# --- edges -------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", list(TORCHAO))
def test_k_past_int32s_exact_range_runs_in_parts(quant):
    """in_features > 131071: torchao runs it; the prepared eager forward raised (K too large).
    Each run of K is exact; the runs' fp32 sums then agree with the float64 product."""
    K = MAX_K_INT8 + 129
    torch.manual_seed(0)
    model = _quantized(nn.Sequential(nn.Linear(K, 16, bias=True)).bfloat16(), quant)
    fusepass.prepare(model)
    lin = model[0]
    x = torch.randn(2, K, dtype=torch.bfloat16)
    from fusepass.integrations.linear import quantize_input

    q, s, zp = quantize_input(x, lin.act)
    acc = q.double() @ lin.weight.double().t()
    if zp is not None:
        acc = acc - zp.double()[:, None] * lin.weight.double().sum(1)[None, :]
    expected = acc * s.double() * lin.weight_scale.double() + lin.bias.double()
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("quant", list(TORCHAO))
def test_an_infinity_in_the_input_gives_nan_outputs_eager_and_compiled(quant):
    """The docs' promise (``docs/OPS.md``); compiled it gave [inf, inf, -inf]."""
    torch.manual_seed(0)
    model = _quantized(nn.Sequential(nn.Linear(128, 3)).bfloat16(), quant)
    fusepass.prepare(model)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    x[0, 5] = float("inf")
    torch._dynamo.reset()
    with torch.no_grad():
        for out in (model(x), torch.compile(model, backend="fusepass", dynamic=False)(x)):
            assert out[0].isnan().all() and out[1].isfinite().all(), out


def test_an_integer_input_is_refused_by_name():
    model = _pair()
    fusepass.prepare(model)
    with pytest.raises(TypeError, match="fusepass.W8A8Linear: the input must be bfloat16, float16 or float32.*int64"):
        model(torch.ones(2, 64, dtype=torch.int64))


def test_a_quantized_linear_as_the_model_itself_is_left_with_the_reason():
    lin = _pair()[0]
    report = fusepass.prepare(lin)
    assert not report.converted and "the model is itself a quantized linear" in report.left["(the model itself)"]
    assert "0 quantized linears converted, 1 left" in str(report)


def test_a_linear_held_under_two_names_is_converted_once_in_both():
    shared = nn.Linear(64, 64)
    model = _quantized(nn.Sequential(shared, nn.ReLU(), shared).bfloat16())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    report = fusepass.prepare(model)
    assert set(report.converted) == {"0", "2"} and model[0] is model[2] and isinstance(model[0], W8A8Linear)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0.05, atol=0.05)


def test_the_backend_points_a_torchao_model_to_prepare_before_its_first_step(caplog, monkeypatch):
    """The one-line path with torchao's weights costs host time on every call (docs/PERFORMANCE.md):
    the backend's warning, at compile time, names ``prepare``; once per process; not for a
    prepared model."""
    import logging

    from fusepass import backend

    monkeypatch.setattr(backend, "_HINTED", False)
    model = _pair()
    with caplog.at_level(logging.WARNING, logger="fusepass"):
        backend._hint_prepare(list(model.parameters()))
        backend._hint_prepare(list(model.parameters()))
    hints = [r.getMessage() for r in caplog.records if "tensor-subclass" in r.getMessage()]
    assert len(hints) == 1 and "takes 2 torchao tensor-subclass weights" in hints[0]
    assert "fusepass.prepare(model) before torch.compile" in hints[0]
    monkeypatch.setattr(backend, "_HINTED", False)
    caplog.clear()
    fusepass.prepare(model)
    backend._hint_prepare([*model.parameters(), *model.buffers()])
    assert not caplog.records


def _python_calls_per_step(step, n: int = 10) -> float:
    import cProfile
    import pstats

    step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        step()
    profile.disable()
    return pstats.Stats(profile).total_calls / n


def test_a_models_host_work_per_step_does_not_grow_with_the_models_compiled_after_it():
    """Several models in one process: nothing of fusepass's (caches, counters, patches, the
    Acts' table, guards) makes a compiled model's step do more once others are compiled after
    it. Counted in Python calls (deterministic, where times on a shared host are not); a
    second model costs the first only Dynamo's failed check of its cache entry, in C++."""
    from torch._dynamo.utils import counters

    sizes = models.Sizes(layers=1, hidden_size=128, intermediate_size=256, heads=4, kv_heads=2, vocab_size=512)
    base = models.random_llama(sizes, 32, torch.device("cpu"), seed=0)
    torch._dynamo.reset()
    counters["stats"].clear()
    steps = []
    with torch.no_grad():
        for quant in ("int8", "int8-asym"):
            model = models.quantized_copy(base, quant, "torchao")
            fusepass.prepare(model)
            inputs = models.decode_inputs(models.prompt(base, 1, 4, seed=1), models.static_cache(model, 1, 32))
            steps.append(lambda fn=torch.compile(model, backend="fusepass", dynamic=False), inputs=inputs: fn(**inputs))
            steps[-1]()  # (compiled here)
            if len(steps) == 1:
                alone = _python_calls_per_step(steps[0])
        assert counters["stats"]["unique_graphs"] == 2
        assert _python_calls_per_step(steps[0]) == alone


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK"])
def test_a_prepared_compressed_tensors_checkpoint_saves_and_loads_bit_for_bit(scheme, tmp_path):
    """fp8 weights (per row, or with one scale per 128x128 block) from a checkpoint
    compressed-tensors wrote: prepared, saved in fusepass's format (the checkpoint's quantizer
    dropped: it no longer describes the modules), loaded back by ``from_pretrained``."""
    pytest.importorskip("compressed_tensors")
    import transformers

    from tests.support import ct_checkpoints as ct

    path, _ = ct.build(tmp_path, scheme)
    model = ct.load(path)
    fusepass.prepare(model)
    assert model.hf_quantizer is None and model.config.quantization_config["quant_method"] == "fusepass"
    model.save_pretrained(tmp_path / "prepared")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", dtype=torch.bfloat16)
    _assert_same_state(model, loaded)
    ids = models.prompt(model, 2, 8, seed=1)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_base_model_prepared_alone_saves_from_its_causal_lm_and_loads_into_either(bf16_model, tmp_path):
    """``prepare(model.model)`` names the linears from the base model; the causal LM that holds
    it saves them under its own names, and both loaders find them (transformers' prefix rule)."""
    import transformers

    model = models.quantized_copy(bf16_model, "int8", "torchao")
    fusepass.prepare(model.model)
    model.lm_head = nn.Linear(SIZES.hidden_size, SIZES.vocab_size, bias=False, dtype=torch.bfloat16)  # (a plain head)
    model.save_pretrained(tmp_path)
    causal = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    base = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = models.prompt(bf16_model, 1, 6, seed=2)
    with torch.no_grad():
        assert torch.equal(causal(ids).logits, model(ids).logits)
        assert torch.equal(base(ids).last_hidden_state, model.model(ids).last_hidden_state)
    assert isinstance(base.layers[0].mlp.up_proj, W8A8Linear)


def test_a_model_with_linears_left_keeps_its_source_config_and_says_so(bf16_model, caplog):
    import logging

    model = models.quantized_copy(bf16_model, "int8", "torchao")
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: out)
    before = model.config.quantization_config if hasattr(model.config, "quantization_config") else None
    with caplog.at_level(logging.WARNING, logger="fusepass.prepare"):
        report = fusepass.prepare(model)
    assert list(report.left) == ["model.layers.0.mlp.down_proj"]
    assert getattr(model.config, "quantization_config", None) is before
    assert "save_pretrained of this model writes its source format's config" in caplog.text


def test_the_traced_body_is_keyed_by_every_file_its_forms_come_from():
    """``w8a8_linear``'s ``source`` argument keys AOTAutograd's cache: the hash of the files
    its traced forms come from, the ops' quantization recipes among them (one recipe each)."""
    import hashlib
    import inspect
    from pathlib import Path

    from fusepass.integrations import linear
    from fusepass.kernels.policy import floors_first
    from fusepass.ops.blockwise import quantize_groups
    from fusepass.ops.dynamic import quantize_rows

    used = {inspect.getsourcefile(f) for f in (linear.quantize_input, quantize_rows, quantize_groups, floors_first)}
    assert used <= set(linear.TRACED_FROM)
    assert linear.SOURCE == hashlib.sha256(b"".join(Path(f).read_bytes() for f in linear.TRACED_FROM)).hexdigest()[:16]
