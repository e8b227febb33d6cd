"""``fusepass demo`` end to end on CPU (a transformers Llama, quantized by torchao or by
hand), its quantizers, and its argument errors.

The two end-to-end runs compile two graphs each (Inductor on CPU: tens of seconds); the
argument errors fail before anything is built.
"""

import re
import sys

import pytest
import torch

import fusepass
from fusepass import cli

# A model as small as the demo takes: 1 layer, 8 quantized linears (7 + lm_head).
TINY_SIZES = ["--layers", "1", "--hidden-size", "128", "--intermediate-size", "256", "--heads", "2",
              "--kv-heads", "1", "--vocab-size", "256"]
SHORT = ["--device", "cpu", "--prompt-len", "16", "--new-tokens", "6"]
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SUMMARY = re.compile(r"^(prefill|decode) b(\d+): fusepass: (\d+) quantized matmuls?, (\d+) fused, (\d+) left alone",
                     re.M)


def _summaries(out: str) -> dict[str, tuple[int, int, int]]:
    """``{"decode b1": (found, fused, left)}`` from the fusion report's summary lines."""
    return {f"{m[1]} b{m[2]}": (int(m[3]), int(m[4]), int(m[5])) for m in SUMMARY.finditer(out)}


def _accuracy(out: str, name: str) -> float:
    """The relative error of ``name``'s decode logits vs the bf16 model's."""
    m = re.search(rf"^    {name} +relative error (\S+), top-1 agreement (\d+)/(\d+) ", out, re.M)
    assert m, out
    return float(m[1])


def _check_report(out: str, graphs: set[str]) -> dict[str, tuple[int, int, int]]:
    """Every graph reported, the 8 quantized linears in each, found = fused + left, and a
    table row per linear, by module path."""
    s = _summaries(out)
    assert set(s) == graphs, out
    for found, fused, left in s.values():
        assert found == 8 and fused + left == found, out
    for proj in PROJS:
        assert re.search(rf"^model\.layers\.0\.{re.escape(proj)}  ", out, re.M), out
    assert re.search(r"^lm_head  ", out, re.M), out
    return s


def _check_accuracy_and_tokens(out: str, new_tokens: int) -> None:
    """The decode logits of the compiled model are as close to bf16's as eager's (W8A8 of a
    random model: a few % off), and the greedy tokens are compared (a near tie may make
    compiled and eager quantized differ, as either may differ from bf16)."""
    assert f"  decode ({new_tokens - 1} steps):" in out, out
    fused, eager = _accuracy(out, "fusepass-compiled"), _accuracy(out, "eager quantized")
    assert fused < 0.1 and fused < 1.5 * eager + 1e-3, out
    m = re.search(rf"^  fusepass-compiled vs eager quantized: (\d+)/{new_tokens} tokens agree", out, re.M)
    assert m and 1 <= int(m[1]) <= new_tokens, out  # the first token comes from the same eager prefill
    assert f"... greedy generation, {new_tokens} tokens: compiling with backend=fusepass (the decode step) done (" \
        in out


def test_demo_default_model_end_to_end(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    assert cli.main(["demo", *SHORT, *TINY_SIZES, "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM, 1 layer, hidden 128" in out and "(random weights from a config)" in out
    assert "torchao Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)" in out
    _check_report(out, {"prefill b1", "prefill b2", "decode b1", "decode b2"})
    assert "... tracing decode b2 for the fusion report done (" in out
    _check_accuracy_and_tokens(out, 6)
    assert "Speed on" not in out  # no timings on CPU unless asked


def test_demo_loads_a_checkpoint_with_handwritten_linears(tmp_path, capsys):
    """--model: from_pretrained of a checkpoint this test saves; --quantizer handwritten:
    the plain-PyTorch W8A8 linears, every one of which fuses in the prefill."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                                      initializer_range=128**-0.5)  # unit-variance activations, as trained
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    argv = ["demo", "--device", "cpu", "--model", str(tmp_path), "--quantizer", "handwritten", "--quant", "int8-asym",
            "--prompt-len", "16", "--new-tokens", "4", "--batch", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"({tmp_path})" in out and "hand-written QuantLinear" in out
    s = _check_report(out, {"prefill b1", "decode b1"})
    assert s["prefill b1"] == (8, 8, 0), out
    _check_accuracy_and_tokens(out, 4)


def test_demo_runs_a_compressed_tensors_checkpoint(tmp_path, capsys):
    """--model PATH to a W8A8 checkpoint in the compressed-tensors format: its own scheme (no
    --quant), prepared, every quantized linear fused, reported as for the others."""
    pytest.importorskip("compressed_tensors")
    from tests.support import ct_checkpoints as ct

    path, _ = ct.build(tmp_path, "W8A8")
    argv = ["demo", "--device", "cpu", "--model", str(path), "--prompt-len", "16", "--new-tokens", "4", "--batch", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "fusepass.prepare: 14 quantized linears converted (int8 14)" in out, out
    assert "W8A8: every linear the checkpoint's own (compressed-tensors;" in out, out
    s = _summaries(out)
    assert s == {"prefill b1": (14, 14, 0), "decode b1": (14, 14, 0)}, out
    _check_accuracy_and_tokens(out, 4)


@pytest.mark.parametrize("fmt", ["fbgemm", "native"])
def test_demo_runs_transformers_fp8_checkpoints(fmt, tmp_path, capsys):
    """--model PATH to transformers' own FP8 formats: FBGEMM FP8 (loaded without fbgemm-gpu) and
    native 128x128-block FP8 (its FP8Linear built on the CPU with the GPU gate skipped, in this
    test only: tests/support/fp8_checkpoints.py), prepared and every quantized linear fused. transformers'
    own modules need the ``kernels`` package and fbgemm-gpu, absent here: the eager reference is
    then the prepared model's, and the demo says so."""
    pytest.importorskip("accelerate")
    from tests.support import fp8_checkpoints as fp8

    path = fp8.fbgemm(tmp_path)[0] if fmt == "fbgemm" else fp8.native(tmp_path, "llama")[0]
    argv = ["demo", "--device", "cpu", "--model", str(path), "--prompt-len", "16", "--new-tokens", "3", "--batch", "1"]
    with fp8.gpu_gate_skipped():
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    count, kind = (fp8.FBGEMM_LINEARS, "fp8") if fmt == "fbgemm" else (fp8.LINEARS, "fp8-block")
    assert f"fusepass.prepare: {count} quantized linears converted ({kind} {count})" in out, out
    assert f"W8A8: every linear the checkpoint's own ({'fbgemm_fp8' if fmt == 'fbgemm' else 'fp8'};" in out, out
    assert _summaries(out) == {"prefill b1": (count, count, 0), "decode b1": (count, count, 0)}, out
    fused = _accuracy(out, "fusepass-compiled")
    assert fused < 0.15 and fused < 1.5 * _accuracy(out, "prepared, eager") + 1e-3, out
    assert "the checkpoint's own eager model failed (" in out and "the prepared one's instead" in out, out


def test_demo_runs_a_native_fp8_moe_checkpoint(tmp_path, capsys):
    """--model PATH to a mixture of experts' W8A8 checkpoint (OLMoE, tiny): native FP8
    (FP8Experts, built with the GPU gate skipped, in this test only). Every linear fused, each
    experts layer on the grouped op in the report; the bf16 reference has its experts
    dequantized with their scales (transformers' own dequantization leaves their raw fp8 values)."""
    pytest.importorskip("accelerate")
    from tests.integrations.test_experts import moe_model
    from tests.integrations.test_experts_checkpoint import _quantized_by_transformers
    from tests.support import fp8_checkpoints as fp8

    moe_model("olmoe", blocks=True).save_pretrained(tmp_path / "bf16")
    _quantized_by_transformers(tmp_path / "bf16").save_pretrained(tmp_path / "q")
    argv = ["demo", "--device", "cpu", "--model", str(tmp_path / "q"), "--prompt-len", "16", "--new-tokens", "3",
            "--batch", "1"]
    with fp8.gpu_gate_skipped():
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert _summaries(out) == {"prefill b1": (8, 8, 0), "decode b1": (8, 8, 0)}, out
    assert out.count("; 2 experts layers on fusepass.scaled_grouped_mm") == 2, out
    assert re.search(r"^model\.layers\.1\.mlp\.experts +scaled_grouped_mm \(experts\) +scaled_grouped_mm", out, re.M), out
    fused = _accuracy(out, "fusepass-compiled")  # (transformers' FP8Experts need a downloaded kernel)
    # fp8 weights and activations of a random 2-layer model, routing flips included: 27-29% here. Not
    # against the eager run's (13-27%): stock Inductor moves this model's bf16 logits 4-7% from eager's
    # at decode (its routing flips too), and the generated tokens then part.
    assert fused < 0.4, out


def test_demo_refuses_a_native_fp8_checkpoint_transformers_dequantized(tmp_path, capsys):
    """On a CPU transformers loads a native FP8 checkpoint dequantized to bf16: nothing W8A8 to
    show, and the demo says why."""
    pytest.importorskip("accelerate")
    from tests.support import fp8_checkpoints as fp8

    path = fp8.native(tmp_path, "llama")[0]
    with pytest.raises(SystemExit, match="no quantized linear it runs .*a native FP8 checkpoint quantized only on a "
                                         "GPU of compute capability 8.9"):
        cli.main(["demo", "--device", "cpu", "--model", str(path), "--no-speed"])


def test_demo_quantized_by_compressed_tensors(capsys):
    """--quantizer compressed-tensors: the random model as its W8A8 checkpoint loads (lm_head
    left bf16), prepared, every quantized linear fused."""
    pytest.importorskip("compressed_tensors")
    assert cli.main(["demo", *SHORT, *TINY_SIZES, "--batch", "1", "--quantizer", "compressed-tensors"]) == 0
    out = capsys.readouterr().out
    assert "fusepass.prepare: 7 quantized linears converted (int8 7)" in out, out
    assert _summaries(out) == {"prefill b1": (7, 7, 0), "decode b1": (7, 7, 0)}, out
    _check_accuracy_and_tokens(out, 6)


def test_demo_fails_where_the_pass_saw_no_quantized_matmul(monkeypatch, capsys):
    """A model whose quantized matmuls never reach the pass (here: none are reported) is a
    failure, not a run with nothing to say."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    from fusepass.demo import fusion, run

    monkeypatch.setattr(fusion, "explain_steps", lambda model, steps, step: {})
    monkeypatch.setattr(run, "_accuracy", lambda *args: True)
    assert cli.main(["demo", *SHORT, *TINY_SIZES, "--batch", "1"]) == 1
    assert "No quantized matmul reached the fusion pass in any graph" in capsys.readouterr().out


@pytest.mark.gpu
def test_demo_on_cuda_with_the_speed_table_and_its_plot(tmp_path, capsys):
    """The CUDA path at small sizes: the prefill compiled too, the speed table (bf16, stock
    torch.compile, fusepass; default mode and CUDA graphs) and its PNG. Compiles 20 graphs."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    pytest.importorskip("matplotlib")
    png = tmp_path / "speed.png"
    argv = ["demo", "--device", "cuda", "--layers", "1", "--hidden-size", "512", "--intermediate-size", "1024",
            "--heads", "4", "--kv-heads", "2", "--vocab-size", "1024", "--prompt-len", "64", "--new-tokens", "4",
            "--batch", "4", "--plot", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "  prefill (64 positions):" in out and "  decode (3 steps):" in out, out
    for model in ("bf16, torch.compile", "W8A8 int8 (torchao), torch.compile", "W8A8 int8 (torchao), fusepass"):
        for mode in ("default", "CUDA graphs"):
            assert f"| {model} | {mode} | " in out, out
    assert not re.search(r"^\| W8A8 int8 \(torchao\), fusepass \|.*fails", out, re.M), out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("quantizer,quant,pattern", [
    ("torchao", "int8-asym", None),
    ("handwritten", "int8", "int_mm_scaled"),
    ("handwritten", "int8-asym", "int_mm_azp_per_token"),
])
def test_quantized_linears_of_the_model(quantizer, quant, pattern):
    """Each quantizer's W8A8 copy stays close to the bf16 model, and explain finds all its
    quantized linears by module path; the hand-written ones all fuse (prefill)."""
    pytest.importorskip("transformers")
    if quantizer == "torchao":
        pytest.importorskip("torchao")
    from fusepass.demo import models

    model = models.random_llama(models.Sizes(1, 128, 256, 2, 1, 256), 32, torch.device("cpu"), seed=0)
    qmodel = models.quantized_copy(model, quant, quantizer)
    ids = models.prompt(model, 2, 12, seed=0)
    with torch.no_grad():
        ref, got = model(ids).logits.float(), qmodel(ids).logits.float()
    assert (got - ref).norm() / ref.norm() < 0.05
    report = fusepass.explain(qmodel, dynamic=False, **models.prefill_inputs(ids))
    assert {d.module for d in report.decisions} == {f"model.layers.0.{p}" for p in PROJS} | {"lm_head"}, str(report)
    if pattern is not None:
        assert {d.pattern for d in report.decisions} == {pattern}, str(report)


@pytest.mark.parametrize("argv,message", [
    (["demo", "--quant", "int4"], "invalid choice: 'int4'"),
    (["demo", "--quant", "fp8", "--device", "cpu"], "--quant fp8 needs a CUDA GPU"),
    (["demo", "--quantizer", "bitsandbytes"], "invalid choice: 'bitsandbytes'"),
    (["demo", "--device", "cpu", "--hidden-size", "100", "--heads", "3"],
     "--hidden-size (100) must divide by --heads (3)"),
    (["demo", "--device", "cpu", "--hidden-size", "120", "--heads", "4", "--kv-heads", "2"], "must be a multiple of 8"),
    (["demo", "--device", "cpu", "--hidden-size", "136", "--heads", "1", "--kv-heads", "1"], "must be multiples of 16"),
    (["demo", "--device", "cpu", "--layers", "0"], "must be >= 1"),
    (["demo", "--device", "cpu", "--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["demo", "--device", "cpu", "--batch", "-1"], "--batch must be >= 1"),
    (["demo", "--layers", "two"], "invalid int value: 'two'"),
    (["demo", "--device", "cpu", "--model", "./no/such/checkpoint"], "--model ./no/such/checkpoint: no such directory"),
    (["demo", "--device", "cpu", "--model", "org/name", "--layers", "2"], "--layers set the random model's sizes"),
    (["demo", "--device", "cpu", "--plot", "speed.png"], "--plot draws the speed table, which runs on CUDA only"),
])
def test_demo_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err + str(e.value.code)
    assert e.value.code != 0 and message in err
    assert "Traceback" not in err


def test_demo_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "cpu", "--speed", "--plot", str(tmp_path / "speed.png")])
    assert e.value.code != 0 and "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "quantizer"), [("transformers", "torchao"), ("torchao", "torchao"),
                                                    ("compressed_tensors", "compressed-tensors")])
def test_demo_without_its_dependencies(module, quantizer, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    name = module.replace("_", "-")
    with pytest.raises(SystemExit, match=rf"fusepass demo needs {name}: pip install 'fusepass\[demo\]'"):
        cli.main(["demo", "--device", "cpu", "--quantizer", quantizer])


def test_demo_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda given but no CUDA GPU is available"):
        cli.main(["demo", "--device", "cuda"])


def test_the_fusion_table_names_the_fused_op():
    """A cell says what the linear became (the op), not the pattern's name: ``dequant_mm`` read as
    "dequantized, then a plain matmul"."""
    from fusepass.demo.fusion import format_reports
    from fusepass.explain import Report
    from fusepass.passes import Decision

    fused = Decision("mm", "layers.0.q_proj", "aten.mm", "", "", pattern="dequant_mm", op="fusepass.scaled_mm")
    partial = Decision("mm_1", "layers.0.o_proj", "aten.mm", "", "", pattern="dequant_mm", op="fusepass.scaled_mm",
                       reason="its value is also used")
    left = Decision("mm_2", "lm_head", "aten.mm", "", "", reason="not quantized")
    table = format_reports({"decode b1": Report([fused, partial, left])}).splitlines()
    assert table[1].split() == ["layers.0.q_proj", "scaled_mm"]
    assert table[2].split() == ["layers.0.o_proj", "scaled_mm", "(in", "part)"]
    assert table[3].split() == ["lm_head", "left", "alone"]
    assert "dequant_mm" not in "\n".join(table[:4])
