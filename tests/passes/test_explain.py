"""fusepass.explain: a report of every candidate quantized matmul."""

import torch

import fusepass
from tests.passes.data import K, M, N, i8, scale


class TwoLinears(torch.nn.Module):
    """One fusable int8 linear, one whose accumulator is also returned (left alone)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = i8(N, K, seed=1), i8(N, N, seed=2)
        self.s1, self.s2 = scale(1, N, seed=3), scale(1, N, seed=4)

    def forward(self, x, sx):
        h = torch._int_mm(x, self.w1.t()).float() * sx * self.s1
        q = h.clamp(-128, 127).round().to(torch.int8)
        acc = torch._int_mm(q, self.w2.t())
        return acc.float() * self.s2, acc


def test_explain_reports_fused_and_left_alone():
    report = fusepass.explain(TwoLinears(), i8(M, K), scale(M, 1))
    assert [d.fused for d in report.decisions] == [True, False]
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "fusepass: 2 quantized matmuls, 1 fused, 1 left alone"
    assert "  aten._int_mm(int8[24, 64] x int8[64, 40])" in text  # in the root module: no path
    assert "fused whole into fusepass.scaled_mm [int_mm_scaled]" in text
    assert "left alone: the accumulator is used by 2 ops; the fused epilogue needs it alone" in text
    assert "at test_explain.py:18: h = torch._int_mm(x, self.w1.t()).float() * sx * self.s1" in text
    assert "at test_explain.py:20: acc = torch._int_mm(q, self.w2.t())" in text


def test_explain_logs_each_decision(caplog):
    with caplog.at_level("DEBUG", logger="fusepass.pass"):
        fusepass.explain(TwoLinears(), i8(M, K), scale(M, 1))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("fusepass: fused _int_mm (int8[24, 64] x int8[64, 40]) into fusepass.scaled_mm") for m in messages)
    assert any("left _int_mm_1" in m and "used by 2 ops" in m for m in messages)


def test_module_paths_as_named_modules_spells_them():
    import torch.fx as fx

    from fusepass.passes.graph import module_path

    node = fx.Graph().placeholder("x")
    for stack_path, want in [
        ("L['self'].layers[0]._modules['q_proj']", "layers.0.q_proj"),
        ("L['fn'].mlp.down_proj", "mlp.down_proj"),
        ("G['model'].lm_head", "lm_head"),
        # transformers 5.24: Dynamo compiles a wrapper that takes the model as its first argument
        ("L['args'][0].model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
        ("L['kwargs']['model'].lm_head", "lm_head"),
        ("G['layers'][3].mlp", "3.mlp"),  # an indexed root keeps its index
        ("L['self']._modules['0']", "0"),
        ("L['self'][0]", "0"),
    ]:
        node.meta["nn_module_stack"] = {"k": (stack_path, torch.nn.Linear)}
        assert module_path(node) == want, stack_path
    node.meta["nn_module_stack"] = {"k": ("L['self']", TwoLinears)}
    assert module_path(node) == "TwoLinears"


def test_explain_says_when_no_graph_reached_the_pass():
    """A frame past Dynamo's recompile limit runs uncompiled, with only a warning: an error
    naming the cause, not an empty report."""
    import pytest

    torch._dynamo.reset()
    model = TwoLinears()
    try:
        with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
            assert fusepass.explain(model, i8(M, K), scale(M, 1)).decisions
            with pytest.raises(RuntimeError, match=r"traced no graph of fn .*torch\._dynamo\.reset\(\)"):
                fusepass.explain(model, i8(M + 8, K), scale(M + 8, 1))  # (another M: a recompile)
    finally:
        torch._dynamo.reset()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.proj(x).relu()


def test_a_prepared_linear_is_reported_in_the_users_terms():
    """A prepared linear's traced form is a float matmul inside fusepass's own forward: the
    report names the user's module, the user's line that calls it, and the quantized operands."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = _Block()
    quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    fusepass.prepare(model)
    report = fusepass.explain(model, torch.randn(3, 256))
    (d,) = report.decisions
    assert d.fused and d.module == "proj"
    assert d.location == "test_explain.py:90: return self.proj(x).relu()", d.location
    assert d.shapes == "int8[3, 256] x int8[256, 128]", d.shapes  # (a @ b: the weight as the matmul reads it)
