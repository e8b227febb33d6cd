"""A real client: torchao's Int8DynamicActivationInt8WeightConfig. Every linear fuses."""

import pytest
import torch

import fusepass
from tests.passes.harness import assert_policy, run_pass

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_  # noqa: E402


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 48, bias=False))
    return m.eval()


def test_torchao_int8_dynamic_fuses_every_linear():
    m = _model()
    quantize_(m, Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(2, 20, 64)
    report = fusepass.explain(m, x)
    assert len(report.decisions) == 2 and all(d.fused for d in report.decisions), str(report)
    r = run_pass(m, x)
    assert sum(r.counts.values()) == 2
    with torch.no_grad():
        eager = m(x)
        unquantized = _model()(x)  # the float model the quantized one approximates
    # Same quantized math as eager torchao (exact int32 products either way)...
    torch.testing.assert_close(r.out, eager, rtol=1e-5, atol=1e-5)
    # ... and no further from the float model than eager is.
    assert_policy(r.out, eager, unquantized)
