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
