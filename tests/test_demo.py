"""``fusepass demo`` end to end on CPU, its model, and its argument errors."""

import copy

import pytest
import torch

import fusepass
from fusepass import cli
from fusepass.demo.model import Shape, build, quantize

SMALL = Shape(layers=2, dim=128, hidden=256, heads=4, kv_heads=2)


def test_demo_runs_and_fuses_every_linear(capsys):
    assert cli.main(["demo", "--device", "cpu", "--layers", "1", "--dim", "128", "--hidden", "256", "--tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "fusepass: 4 quantized matmuls, 4 fused, 0 left alone" in out
    for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert f"layers.0.{proj}: aten._int_mm(int8[24, " in out
    assert "fused vs eager quantized:  max abs" in out and "fused vs bf16 model:" in out
    assert "... compiling with backend='fusepass' and running done (" in out
    assert out.rstrip().endswith("Every quantized linear fused.")


@pytest.mark.parametrize("scheme,pattern", [("int8", "int_mm_scaled"), ("int8-azp", "int_mm_azp_per_token")])
def test_every_linear_of_the_model_fuses(scheme, pattern):
    model = build(SMALL, "cpu")
    qmodel = quantize(copy.deepcopy(model), scheme)
    x = torch.randn(1, 24, SMALL.dim, dtype=torch.bfloat16)
    report = fusepass.explain(qmodel, x)
    assert len(report.decisions) == 4 * SMALL.layers
    assert {d.pattern for d in report.decisions} == {pattern}
    with torch.no_grad():  # the quantized model approximates the bf16 one
        rel = (qmodel(x).float() - model(x).float()).norm() / model(x).float().norm()
    assert rel < 0.05


@pytest.mark.parametrize("argv,message", [
    (["demo", "--scheme", "fp8", "--device", "cpu"], "--scheme fp8 needs a CUDA GPU"),
    (["demo", "--scheme", "int4"], "invalid choice: 'int4'"),
    (["demo", "--dim", "100", "--heads", "3"], "--dim (100) must divide by --heads (3)"),
    (["demo", "--dim", "120", "--heads", "4", "--kv-heads", "2"], "must be multiples of 16"),
    (["demo", "--layers", "0"], "must be >= 1"),
    (["demo", "--tokens", "0", "--device", "cpu"], "--tokens and --decode-batch must be >= 1"),
    (["demo", "--layers", "two"], "invalid int value: 'two'"),
])
def test_demo_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err + str(e.value.code)
    assert e.value.code != 0 and message in err


def test_demo_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda given but no CUDA GPU is available"):
        cli.main(["demo", "--device", "cuda", "--layers", "1", "--dim", "128", "--hidden", "256"])
