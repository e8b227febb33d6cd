"""transformers' own FP8 checkpoints: native FP8 (``FP8Linear``, 128x128 blocks or per-tensor,
dynamic or static activations) and FBGEMM FP8 (``FbgemmFp8Linear``), built as the hub's are
(``fp8_checkpoints.py``; on a CPU the FP8 quantizer's GPU gate is skipped there, in these tests
only) and loaded with ``from_pretrained``. ``fusepass.prepare`` converts every quantized linear,
the checkpoint's fp8 values and scales bit for bit, siblings joined; the prepared model runs
with no ``kernels`` package and no fbgemm-gpu, eager and compiled, every linear fused at prefill
and decode; its logits are within fp8's own error of the bf16 model's. What it cannot take is
left, with the reason.
"""

from __future__ import annotations

import builtins
import re

import pytest
import torch

import fusepass
from fusepass.passes.join import NAME as JOINED
from fusepass.passes.quantize_in import GROUPS_NAME as QUANTIZED_GROUPS_IN, NAME as QUANTIZED_IN

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from fusepass.demo import models  # noqa: E402
from tests.support import fp8_checkpoints as fp8  # noqa: E402
from tests.support.helpers import prepared_step_decisions  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint, the bf16 model's directory)."""
    root = tmp_path_factory.mktemp("fp8")
    built = {f"block-{arch}": fp8.native(root / arch, arch) for arch in fp8.ARCHS}
    built["tensor"] = fp8.native(root / "tensor", "llama", block=None)
    built["fbgemm"] = fp8.fbgemm(root / "fbgemm")
    calibration = models.prompt(fp8.load(built["tensor"][1]), 2, 8, seed=5)
    built["static"] = fp8.static(root, "llama", calibration), built["tensor"][1]
    return built


KIND = {"block-llama": "fp8-block", "block-qwen3": "fp8-block", "tensor": "fp8", "static": "fp8-static",
        "fbgemm": "fp8"}
COUNT = {name: fp8.FBGEMM_LINEARS if name == "fbgemm" else fp8.LINEARS for name in KIND}
PATTERN = {"fp8-block": "dequant_mm_blockwise", "fp8": "dequant_mm", "fp8-static": "dequant_mm"}


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _quantized_linears(model) -> dict:
    """path -> (weight, scale as prepare keeps it) of the model's transformers FP8 linears."""
    out = {}
    for path, m in model.named_modules():
        if type(m).__name__ == "FP8Linear":
            s = m.weight_scale_inv.detach()
            out[path] = m.weight.detach().clone(), (s.reshape(1).expand(m.out_features) if m.block_size is None else s)
        elif type(m).__name__ == "FbgemmFp8Linear":
            out[path] = m.weight.detach().clone(), m.weight_scale.detach().reshape(-1)
    return out


@pytest.mark.parametrize("name", list(KIND))
def test_prepare_keeps_the_checkpoints_values(checkpoints, name):
    model = fp8.load(checkpoints[name][0])
    before = _quantized_linears(model)
    assert len(before) == COUNT[name]
    report = fusepass.prepare(model)
    assert report.converted == {path: KIND[name] for path in before} and not report.left, report
    # q/k/v/o (one input width) and gate/up share a buffer a layer; static scales are each their own
    assert len(report.joined) == (0 if name == "static" else 2 * fp8.SIZES["num_hidden_layers"] - (name == "fbgemm"))
    for path, (weight, scale) in before.items():
        new = model.get_submodule(path)
        assert isinstance(new, fusepass.W8A8Linear) and new.weight.dtype == FP8
        assert torch.equal(new.weight.view(torch.uint8), weight.view(torch.uint8)), path
        assert torch.equal(new.weight_scale, scale.float()), path
    explained = torch._dynamo.explain(model)(models.prompt(model, 2, 8, seed=0))
    assert explained.graph_break_count == 0, explained.break_reasons


def test_the_checkpoints_are_the_formats_of_the_hub(checkpoints):
    """As a hub checkpoint's: the native format's config and its tensors' names and dtypes
    (transformers wrote them); FBGEMM's as Meta's releases hold them."""
    from safetensors import safe_open

    config = fp8.load(checkpoints["block-qwen3"][0]).config.quantization_config
    assert (config.quant_method, list(config.weight_block_size), config.activation_scheme) == ("fp8", [128, 128],
                                                                                               "dynamic")
    with safe_open(checkpoints["block-qwen3"][0] / "model.safetensors", "pt") as f:
        k = "model.layers.0.self_attn.k_proj"
        assert f.get_tensor(f"{k}.weight").dtype == FP8 and f.get_tensor(f"{k}.weight").shape == (128, 256)
        assert f.get_tensor(f"{k}.weight_scale_inv").dtype == torch.float32
        assert f.get_tensor(f"{k}.weight_scale_inv").shape == (1, 2)
    with safe_open(checkpoints["fbgemm"][0] / "model.safetensors", "pt") as f:
        d = "model.layers.1.mlp.down_proj"
        assert f.get_tensor(f"{d}.weight").dtype == FP8 and f.get_tensor(f"{d}.weight_scale").shape == (256, 1)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(KIND))
def test_logits_within_fp8s_own_error(checkpoints, name):
    """Against the float model: within 1.5x the error of the checkpoint's weights alone
    (dequantized, activations in bf16), which fp8 activations add to (10.5% against 7.9% for
    the 128x128 blocks here)."""
    path, float_dir = checkpoints[name]
    ids = models.prompt(fp8.load(float_dir), 2, 8, seed=1)
    model = fp8.load(path)
    weights_alone = _dequantized(model)
    fusepass.prepare(model)
    with torch.no_grad():
        reference = fp8.load(float_dir).float()(ids).logits
        ours, theirs = model(ids).logits, weights_alone(ids).logits
    assert torch.isfinite(ours).all()
    assert _rel(ours, reference) <= 1.5 * _rel(theirs, reference) + 1e-3, (_rel(ours, reference), _rel(theirs, reference))


def _dequantized(model):
    """A copy of ``model`` whose FP8 linears are bf16 nn.Linears of their dequantized weights."""
    import copy

    out = copy.deepcopy(model)
    for path, (weight, scale) in _quantized_linears(model).items():
        parent, _, child = path.rpartition(".")
        old = out.get_submodule(path)
        spread = (scale.repeat_interleave(128, 0).repeat_interleave(128, 1) if scale.dim() == 2 else scale[:, None])
        new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, dtype=torch.bfloat16)
        new.weight.data = (weight.float() * spread).to(torch.bfloat16)
        setattr(out.get_submodule(parent), child, new)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("name", ["block-llama", "block-qwen3", "fbgemm", "static"])
def test_every_quantized_linear_fuses(checkpoints, name, step, batch, device):
    decisions, found = prepared_step_decisions(fp8.load(checkpoints[name][0]).to(device), step, batch)
    assert len(decisions) == COUNT[name] and all(d.fused for d in decisions), decisions
    joined = found.pop(JOINED, 0)
    found.pop(QUANTIZED_IN, 0)
    # (at decode b1 each block-wise launch, q/k/v, o, gate/up and down, quantizes its row's groups)
    in_launch = 4 * fp8.SIZES["num_hidden_layers"] if KIND[name] == "fp8-block" and (step, batch) == ("decode", 1) else 0
    assert found.pop(QUANTIZED_GROUPS_IN, 0) == in_launch, found
    assert found == {PATTERN[KIND[name]]: COUNT[name]}, found
    # (q/k/v and gate/up a layer; FBGEMM's first layer has its attention in bf16; static: none)
    assert joined == {"static": 0, "fbgemm": 2 * fp8.SIZES["num_hidden_layers"] - 1}.get(
        name, 2 * fp8.SIZES["num_hidden_layers"]), (joined, found)


def test_compiled_with_fusepass_within_fp8s_error(checkpoints):
    """For real (Inductor's C++ on the CPU), a block-FP8 Qwen3's decode step, against the float
    model: within 1.5x the prepared eager model's error. (Not equal to eager's: a bf16 value
    that Inductor's fused RMSNorm rounds otherwise can land on the next e4m3 step, 6% of it;
    stock Inductor's own compile of the prepared forms differed from eager by 6.4%, fusepass's
    by 4.5%, eager from the float model by 8.9%.)"""
    path, float_dir = checkpoints["block-qwen3"]
    model, reference = fp8.load(path), fp8.load(float_dir)
    fusepass.prepare(model)
    ids = models.prompt(model, 1, 8, seed=3)
    with torch.no_grad():
        ref = reference(**models.decode_inputs(ids, models.static_cache(reference, 1, 16))).logits
        eager = model(**models.decode_inputs(ids, models.static_cache(model, 1, 16))).logits
        compiled = torch.compile(model, backend="fusepass", dynamic=False)
        fused = compiled(**models.decode_inputs(ids, models.static_cache(model, 1, 16))).logits
    assert torch.isfinite(fused).all()
    assert _rel(fused, ref) <= 1.5 * _rel(eager, ref), (_rel(fused, ref), _rel(eager, ref))


def test_runs_without_the_kernels_package(checkpoints, monkeypatch):
    """Unprepared, transformers' FP8Linear needs the ``kernels`` package (a hub download) and
    fails without it; prepared, the model never asks for it."""
    real_import = builtins.__import__

    def no_kernels(name, *args, **kwargs):
        if name == "kernels" or name.startswith("kernels."):
            raise ImportError("no kernels package here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kernels)
    from transformers.integrations import hub_kernels
    from transformers.utils import import_utils

    for module in (import_utils, hub_kernels):
        if hasattr(module, "is_kernels_available"):
            monkeypatch.setattr(module, "is_kernels_available", lambda *a, **k: False)
    model = fp8.load(checkpoints["block-llama"][0])
    ids = models.prompt(model, 1, 8, seed=4)
    with pytest.raises(ImportError), torch.no_grad():
        model(ids)
    fusepass.prepare(model)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_fbgemm_checkpoint_loads_without_fbgemm_gpu(checkpoints):
    """transformers' FBGEMM quantizer needs fbgemm-gpu (and a GPU) to load; with fusepass
    imported the checkpoint loads anyway, its bf16 modules left as the config says, its
    FbgemmFp8Linears' ``input_scale_ub`` set from the config, and their forward says to prepare."""
    model = fp8.load(checkpoints["fbgemm"][0])
    q0, up1 = model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.up_proj
    assert type(q0) is torch.nn.Linear and q0.weight.dtype == torch.bfloat16
    assert type(up1).__name__ == "FbgemmFp8Linear" and float(up1.input_scale_ub) == fp8.ACTIVATION_SCALE_UB
    with pytest.raises(RuntimeError, match=r"FbgemmFp8Linear calls fbgemm-gpu, not installed here: run the model after "
                                           r"fusepass.prepare\(model\)"), torch.no_grad():
        model(models.prompt(model, 1, 8, seed=0))


def test_fbgemm_activations_bounded_by_the_ub():
    """FBGEMM's recipe: a row's amax at most ``activation_scale_ub`` (the values past it
    clamped to e4m3's 448), against the recipe written out."""
    from fusepass.integrations.linear import Act, Joint, W8A8Linear

    g = torch.Generator().manual_seed(0)
    w, s = fp8.fbgemm_rows(torch.randn(256, 256, generator=g))
    x = torch.randn(3, 256, generator=g)
    x[0, 5] = 50.0  # past the bound below
    lin = W8A8Linear(Joint(w, s.reshape(-1)), 0, 256, Act("fp8", floor=1e-12, ceiling=10.0))
    amax = x.abs().amax(1, keepdim=True).clamp(1e-12, 10.0)
    xq = (x / (amax / 448)).clamp(-448, 448).to(FP8).float() * (amax / 448)
    torch.testing.assert_close(lin(x), xq @ (w.float() * s).t(), rtol=1e-5, atol=1e-5)
    assert lin(x)[0].abs().max() < (x[0].clamp(-10, 10) @ (w.float() * s).t()).abs().max() * 1.2


def test_prepared_fp8_models_save_and_load_as_fusepass_checkpoints(checkpoints, tmp_path):
    """``save_pretrained`` of a prepared FBGEMM or static-scale model writes fusepass's format
    (version 2: an amax ceiling, a static activation scale), and ``from_pretrained`` loads it back
    bit for bit, with the same logits."""
    import transformers

    for name in ("fbgemm", "static"):
        model = fp8.load(checkpoints[name][0])
        fusepass.prepare(model)
        model.save_pretrained(tmp_path / name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.bfloat16)
        assert loaded.config.quantization_config["version"] == 2
        ids = models.prompt(model, 2, 8, seed=6)
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits), name
        a, b = model.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
                                            if a[k].dtype == FP8), name


def _fp8_linear(**kwargs):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    return FP8Linear(256, 256, **kwargs)


@pytest.mark.parametrize(("make", "why"), [
    (lambda: _fp8_linear(block_size=(128, 128), scale_fmt="ue8m0"), "UE8M0"),
    (lambda: _fp8_linear(block_size=(64, 64)), r"\[64, 64\] weight blocks: fusepass takes 128x128 blocks"),
    (lambda: _fp8_linear(block_size=(128, 128), activation_scheme="static"),
     "static activation scale and 128x128 weight blocks"),
    (lambda: _fp8_linear(block_size=None, activation_scheme="static"), "static activation_scale of 0.0"),
], ids=["ue8m0", "64x64", "static-block", "static-zero"])
def test_what_prepare_cannot_take_is_left_with_the_reason(make, why):
    linear = make()
    if linear.activation_scale is not None:
        linear.activation_scale.data.zero_()
    model = torch.nn.Sequential(linear)
    report = fusepass.prepare(model)
    assert not report.converted and list(report.left) == ["0"], report
    assert why in report.left["0"] or __import__("re").search(why, report.left["0"]), report.left["0"]
    assert model[0] is linear


def test_fp4_weights_and_an_unset_ub_are_left():
    from transformers.integrations.fbgemm_fp8 import FbgemmFp8Linear

    fp4 = _fp8_linear(block_size=(128, 128))
    fp4.weight = torch.nn.Parameter(torch.zeros(256, 128, dtype=torch.int8), requires_grad=False)
    unset = FbgemmFp8Linear(256, 256, bias=False)  # (input_scale_ub 0: never set from a config)
    report = fusepass.prepare(torch.nn.Sequential(fp4, unset))
    assert not report.converted
    assert "FP4-packed weights" in report.left["0"] and "input_scale_ub 0.0" in report.left["1"], report


def test_subclasses_and_other_fp8_modules_are_left_named():
    """A subclass of FP8Linear (its behaviour would be lost) and transformers' FP8Embedding (no
    linear) are left, with the reason; so the model keeps its source format's config."""
    from transformers.integrations.finegrained_fp8 import FP8Embedding, FP8Linear

    class Mine(FP8Linear):
        pass

    model = torch.nn.Sequential(Mine(256, 256, block_size=(128, 128)), FP8Embedding(16, 256))
    report = fusepass.prepare(model)
    assert not report.converted and set(report.left) == {"0", "1"}, report
    assert "a subclass of transformers' FP8Linear" in report.left["0"]
    assert "transformers' FP8Embedding: not a linear fusepass converts" in report.left["1"]


def test_a_static_scale_must_be_one_positive_finite_value():
    from fusepass.integrations.linear import Act, Joint, W8A8Linear

    w, s = (torch.randn(128, 128) * 10).to(FP8), torch.ones(128)
    for bad, why in ((None, "needs an input_scale"), (torch.tensor(0.0), "got 0.0"), (torch.ones(2), "of shape (2,)")):
        with pytest.raises(ValueError, match=re.escape(why)):
            W8A8Linear(Joint(w, s, input_scale=bad), 0, 128, Act("fp8-static"))
    lin = W8A8Linear(Joint(w, s, input_scale=torch.tensor(0.5)), 0, 128, Act("fp8-static"))
    state = {**lin.state_dict(), "input_scale": torch.tensor(float("inf"))}
    with pytest.raises(RuntimeError, match="input_scale: an fp8-static activation scale must be one positive finite "
                                           "value; got inf"):
        lin.load_state_dict(state)
    assert float(lin.input_scale) == 0.5


def test_a_fusepass_checkpoint_without_its_static_scale_is_refused(checkpoints, tmp_path):
    """A fusepass checkpoint that lacks a tensor (here a static scale) is refused as it loads,
    naming it: transformers would fill it with its own initialization and only warn."""
    import transformers
    from safetensors.torch import load_file, save_file

    model = fp8.load(checkpoints["static"][0])
    fusepass.prepare(model)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.input_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"fusepass: the checkpoint lacks model.layers.0.mlp.up_proj.input_scale$"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)


def test_fbgemm_llama4_experts_need_fbgemm_gpu():
    """Without fbgemm-gpu, an FBGEMM FP8 checkpoint whose experts only fbgemm-gpu runs is refused as
    it loads, saying so (its FbgemmFp8Llama4TextExperts would fail at every forward)."""
    from transformers import FbgemmFp8Config
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    class Llama4TextExperts(torch.nn.Module):  # (what transformers would turn into FbgemmFp8Llama4TextExperts)
        pass

    loader = AUTO_QUANTIZER_MAPPING["fbgemm_fp8"](FbgemmFp8Config(), pre_quantized=True)
    loader.without_fbgemm = True
    with pytest.raises(ImportError, match=r"MoE experts \(Llama-4's\) run on fbgemm-gpu's kernels only"):
        loader._process_model_before_weight_loading(torch.nn.Sequential(Llama4TextExperts()))
