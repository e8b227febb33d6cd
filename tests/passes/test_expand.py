"""The pipeline's first step (``passes/expand.py``): a prepared linear reaches the pass as one
``fusepass::w8a8_linear`` node (Dynamo and AOTAutograd trace one node, not its ~20 ops), and
the step replaces each by its ATen forms, siblings' copies of one quantization merged into one,
each new node keeping its linear's source line. (The forms' numerics: tests/integrations/
test_prepare.py, test_the_expanded_form_computes_the_eager_forward.)"""

import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import fusepass
from fusepass._compat import inductor_decompositions
from fusepass.integrations.linear import Act, Joint, W8A8Linear
from fusepass.passes.expand import expand

W8A8 = torch.ops.fusepass.w8a8_linear.default


class QK(nn.Module):
    """Two siblings on one activation, rows [0, 64) and [64, 96) of one joint int8 weight."""

    def __init__(self, kind="int8"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        joint = Joint(torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8), torch.rand(96, generator=g) / 50,
                      None, None, None)
        self.q, self.k = W8A8Linear(joint, 0, 64, Act(kind)), W8A8Linear(joint, 64, 96, Act(kind))

    def forward(self, x):
        return self.q(x), self.k(x)


def _aot_graph(module, x) -> torch.fx.GraphModule:
    """The forward graph AOTAutograd gives a backend (Inductor's decompositions), before any pass."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=aot_autograd(fw_compiler=keep, decompositions=inductor_decompositions()))(x)
    (gm,) = graphs
    return gm


def _targets(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_aot_traces_a_prepared_linear_as_one_node():
    gm = _aot_graph(QK(), torch.randn(3, 64, dtype=torch.bfloat16))
    assert len(_targets(gm, "w8a8_linear")) == 2
    assert not _targets(gm, "amax") and not _targets(gm, "aten.mm")


def test_expanded_into_the_forms_with_one_quantization_and_the_users_lines():
    module, x = QK(), torch.randn(3, 64, dtype=torch.bfloat16)
    gm = _aot_graph(module, x)
    before = set(gm.graph.nodes)
    assert expand(gm.graph) == 2
    assert not _targets(gm, "w8a8_linear")
    assert len(_targets(gm, "aten.mm")) == 2
    # (the per-token quantization of x, once: its NaN for an infinite scale merged too)
    assert len(_targets(gm, "amax")) == 1 and len(_targets(gm, "where")) == 1
    new = [n for n in gm.graph.nodes if n not in before and n.op == "call_function"]
    assert new and all("test_expand.py" in n.meta.get("stack_trace", "") for n in new)
    assert all(n.meta.get("nn_module_stack") for n in new)
    gm.graph.lint()


def test_a_graph_without_the_node_is_left_as_it_is():
    gm = _aot_graph(nn.Linear(8, 8), torch.randn(2, 8))
    nodes = [n.format_node() for n in gm.graph.nodes]
    assert expand(gm.graph) == 0
    assert [n.format_node() for n in gm.graph.nodes] == nodes


def test_the_pass_fuses_the_expanded_siblings_as_one_matmul():
    report = fusepass.explain(QK(), torch.randn(3, 64, dtype=torch.bfloat16))
    assert [d.fused for d in report.decisions] == [True, True]
    assert [d.module for d in report.decisions] == ["q", "k"]
    assert all("test_expand.py" in d.location for d in report.decisions)
