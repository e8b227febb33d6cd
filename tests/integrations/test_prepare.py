"""``fusepass.prepare``: torchao's quantized weights as plain-tensor ``W8A8Linear``s.

For each scheme torchao writes for W8A8 (int8 with symmetric or asymmetric per-token
activations, fp8 per-row): every quantized linear converted with the checkpoint's own values,
siblings sharing one buffer; the eager model's logits within the numerics policy against the
float model; every linear fused, q/k/v and gate/up joined, at prefill and decode (batch 1
and 4). Anything else is left as it is, with its reason. One test compiles for real.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fusepass
from fusepass.backend import capture_backend
from fusepass.integrations.linear import Act, quantize_input
from fusepass.passes import FusePass, PassConfig
from fusepass.passes.join import NAME as JOINED
from fusepass.passes.quantize_in import NAME as QUANTIZED_IN

pytest.importorskip("transformers")
pytest.importorskip("torchao")
from fusepass.demo import models  # noqa: E402

SIZES = models.Sizes(layers=2, hidden_size=128, intermediate_size=256, heads=4, kv_heads=2, vocab_size=512)
LINEARS = 7 * SIZES.layers + 1  # q k v o gate up down per layer, and lm_head
# the compile-time form each scheme's linears match (integrations/linear.py)
PATTERN = {"int8": {"dequant_mm"}, "int8-asym": {"int_mm_azp_per_token"}}  # (also at M = 1: joinable)


@pytest.fixture(scope="module")
def bf16_model():
    return models.random_llama(SIZES, 64, torch.device("cpu"), seed=0)


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _prepared(bf16_model, quant: str, **kwargs):
    model = models.quantized_copy(bf16_model, quant, "torchao")
    return model, fusepass.prepare(model, **kwargs)


@pytest.mark.parametrize("quant", list(PATTERN))
def test_prepare_converts_every_torchao_linear_with_its_own_values(bf16_model, quant):
    torchao_model = models.quantized_copy(bf16_model, quant, "torchao")
    weight = torchao_model.model.layers[0].self_attn.k_proj.weight
    model, report = _prepared(bf16_model, quant)
    assert len(report.converted) == LINEARS and set(report.converted.values()) == {quant} and not report.left
    # per layer: q/k/v/o share a buffer (one input width), gate/up another; down and lm_head alone
    assert sorted(map(len, report.joined)) == [2] * SIZES.layers + [4] * SIZES.layers
    assert str(report).startswith(f"fusepass.prepare: {LINEARS} quantized linears converted ({quant} {LINEARS})")
    k = model.model.layers[0].self_attn.k_proj
    assert isinstance(k, fusepass.W8A8Linear) and k.act.kind == quant
    assert k.joint is model.model.layers[0].self_attn.q_proj.joint
    rows = k.joint.weight[k.lo:k.hi]
    assert torch.equal(rows, weight.qdata) and torch.equal(k.joint.weight_scale[k.lo:k.hi], weight.scale.float().flatten())
    assert (k.joint.colsum is not None) == (quant == "int8-asym")
    if quant == "int8-asym":
        assert torch.equal(k.joint.colsum[k.lo:k.hi], weight.qdata.sum(1, dtype=torch.int32))


@pytest.mark.parametrize("quant", list(PATTERN))
def test_prepared_eager_logits_are_as_close_to_float_as_torchao(bf16_model, quant):
    torchao_model = models.quantized_copy(bf16_model, quant, "torchao")
    model, _ = _prepared(bf16_model, quant)
    ids = models.prompt(bf16_model, 2, 8, seed=1)
    with torch.no_grad():
        reference = bf16_model.float()(ids).logits
        bf16_model.bfloat16()
        theirs, ours = torchao_model(ids).logits, model(ids).logits
    assert torch.isfinite(ours).all()
    assert _rel(ours, reference) <= 1.1 * _rel(theirs, reference) + 1e-3, (_rel(ours, reference), _rel(theirs, reference))


def _graph_counts(model, inputs: dict, config: PassConfig | None = None) -> tuple[list, dict, torch.Tensor]:
    decisions = []
    pass_ = FusePass(config)
    counters["fusepass"].clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture_backend(lambda gm: decisions.extend(pass_.run(gm.graph))),
                             dynamic=False)
    with torch.no_grad():
        out = compiled(**inputs).logits
    return decisions, dict(counters["fusepass"]), out


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("quant", list(PATTERN))
def test_prepared_model_fuses_every_linear_and_joins_siblings(bf16_model, quant, step, batch):
    model, _ = _prepared(bf16_model, quant)
    ids = models.prompt(bf16_model, batch, 8, seed=2)
    inputs = (dict(input_ids=ids) if step == "prefill"
              else models.decode_inputs(ids, models.static_cache(model, batch, 16)))
    with torch.no_grad():
        eager = model(**{k: v for k, v in inputs.items() if k != "past_key_values"}, use_cache=False).logits \
            if step == "prefill" else None
    decisions, counts, out = _graph_counts(model, inputs)
    # (fused whole, or at M = 1 up to a residual add that reads as a bias: "in part")
    assert len(decisions) == LINEARS and all(d.fused for d in decisions), [d for d in decisions if not d.fused]
    joined = counts.pop(JOINED, 0)
    # (outside CUDA graphs, each o_proj's and down_proj's int8 row quantized in its M = 1 launch:
    # passes/quantize_in.py)
    assert counts.pop(QUANTIZED_IN, 0) == (2 * SIZES.layers if (quant, step, batch) == ("int8", "decode", 1) else 0)
    assert set(counts) <= PATTERN[quant] and sum(counts.values()) == LINEARS, counts
    assert joined == 2 * SIZES.layers, (joined, counts)  # q/k/v and gate/up
    if eager is not None:  # (quantized activations round differently in the traced order)
        assert _rel(out, eager) < 0.05


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_quantize_in_gemv_takes_each_o_proj_and_down_proj_at_decode_b1(bf16_model, step):
    """``PassConfig(quantize_in_gemv=True)`` (the default outside CUDA graphs): each layer's
    o_proj (its input: attention's output) and down_proj (its input: the SiLU-mul of gate/up's
    joined output) at decode b1 become one ``scaled_mm_dynamic`` each; the logits as with
    ``False`` (on the CPU the op quantizes with eager's ops)."""
    model, _ = _prepared(bf16_model, "int8")
    ids = models.prompt(bf16_model, 1, 8, seed=2)
    inputs = (lambda: dict(input_ids=ids)) if step == "prefill" else \
        (lambda: models.decode_inputs(ids, models.static_cache(model, 1, 16)))
    _, counts, out = _graph_counts(model, inputs(), PassConfig(quantize_in_gemv=True))
    _, plain, want = _graph_counts(model, inputs(), PassConfig(quantize_in_gemv=False))
    assert counts.pop(QUANTIZED_IN, 0) == (2 * SIZES.layers if step == "decode" else 0) and counts == plain, counts
    assert torch.equal(out, want)


def test_prepare_join_false_keeps_a_buffer_per_linear(bf16_model):
    model, report = _prepared(bf16_model, "int8", join=False)
    assert len(report.converted) == LINEARS and not report.joined
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.joint is not attn.k_proj.joint
    _, counts, _ = _graph_counts(model, dict(input_ids=models.prompt(bf16_model, 4, 8, seed=3)))  # (M = 32)
    # unjoined, each layer's q/k/v and gate/up run as one grouped launch
    assert JOINED not in counts and counts == {"dequant_mm": LINEARS, "scaled_mm_group": 2 * SIZES.layers}


def test_prepare_fp8_per_row_weights():
    """torchao's Float8Tensor (made on the CPU here: its config refuses a CPU) converts to an
    fp8 W8A8Linear whose eager output is the per-token fp8 product of the dequantized values."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor, QuantizeTensorToFloat8Kwargs

    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=True, dtype=torch.bfloat16)
    w = Float8Tensor.from_hp(lin.weight.detach(), granularity=PerRow(),
                             act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerRow()))
    lin.weight = nn.Parameter(w, requires_grad=False)
    model = nn.Sequential(lin)
    report = fusepass.prepare(model)
    assert report.converted == {"0": "fp8"}
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    q, s, _ = quantize_input(x, Act("fp8"))
    expected = (q.double() * s.double()) @ (w.qdata.double() * w.scale.double()).t() + lin.bias.double()
    out = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("config", "why"), [
    ("Int8WeightOnlyConfig()", "weight-only"),
    ("Int8DynamicActivationInt8WeightConfig(granularity=PerTensor())", "only per-row weight scales"),
])
def test_prepare_leaves_other_schemes_with_the_reason(config, why, caplog):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, PerTensor, quantize_

    model = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16), nn.Linear(32, 16, dtype=torch.bfloat16))
    scope = {"Int8WeightOnlyConfig": Int8WeightOnlyConfig, "PerTensor": PerTensor,
             "Int8DynamicActivationInt8WeightConfig": Int8DynamicActivationInt8WeightConfig}
    quantize_(model, eval(config, scope))
    with caplog.at_level(logging.WARNING, logger="fusepass.prepare"):
        report = fusepass.prepare(model)
    assert not report.converted and set(report.left) == {"0", "1"}
    assert all(why in reason for reason in report.left.values()), report.left
    assert f"left 0: {report.left['0']}" in str(report)
    assert "left 2 quantized linears as they are: " in caplog.text and report.left["0"] in caplog.text
    assert type(model[0]) is nn.Linear  # untouched


def test_prepare_leaves_plain_models_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    report = fusepass.prepare(model)
    assert not report.converted and not report.left and type(model[0]) is nn.Linear


def test_prepared_model_keeps_its_quantized_dtypes_through_to_dtype(bf16_model):
    """``model.half()`` / ``.to(dtype)`` convert floating tensors, fp8 weights and fp32 scales
    among them: a prepared model's keep their dtypes (only biases follow)."""
    model, _ = _prepared(bf16_model, "int8")
    k = model.model.layers[0].self_attn.k_proj
    scale = k.joint.weight_scale.clone()
    model.to(torch.float16)
    assert k.joint.weight.dtype == torch.int8 and torch.equal(k.joint.weight_scale, scale)
    with torch.no_grad():
        assert model(models.prompt(bf16_model, 1, 4, seed=5)).logits.dtype == torch.float16


def _sibling_linears(n: int, act: Act) -> nn.Module:
    from fusepass.integrations.linear import Joint, W8A8Linear

    joint = Joint(torch.randint(-128, 128, (4 * n, 8), dtype=torch.int8), torch.rand(4 * n) / 100)
    return nn.ModuleList([W8A8Linear(joint, 4 * i, 4 * i + 4, act) for i in range(n)])


def test_a_modules_act_is_guarded_once_per_distinct_act_not_per_module():
    """Dynamo guards each value a forward reads once per source: the Act is read from the
    module-level table, so its guards do not grow with the number of modules."""
    def guards(n):
        names = []

        def record(entries):
            names.extend(e.name for e in entries)
            return [True] * len(entries)
        linears = _sibling_linears(n, Act("int8"))
        fn = torch.compile(lambda x: [m(x) for m in linears], backend="eager", options={"guard_filter_fn": record})
        fn(torch.randn(2, 8))
        return names
    one, three = guards(1), guards(3)
    assert not [name for name in three if ".act" in name.replace(".act_index", "")]
    assert sum("ACTS" in name for name in three) == sum("ACTS" in name for name in one) > 0


def test_a_new_act_does_not_recompile_the_models_compiled_before_it():
    from fusepass.integrations import linear

    linears = _sibling_linears(2, Act("int8", divisor=126.0))
    frames = []
    fn = torch.compile(lambda x: [m(x) for m in linears], backend=lambda gm, ex: frames.append(gm) or gm.forward)
    x = torch.randn(2, 8)
    fn(x)
    _sibling_linears(1, Act("int8", divisor=125.0))  # another model's scheme, after the compile
    fn(x)
    assert len(frames) == 1 and Act("int8", divisor=125.0) in linear.ACTS


def test_a_prepared_module_pickles_with_its_act(monkeypatch):
    import copy
    import pickle

    from fusepass.integrations import linear

    model = _sibling_linears(2, Act("int8", divisor=127.0))
    x = torch.randn(3, 8)
    expected = [m(x) for m in model]
    data = pickle.dumps(model)
    monkeypatch.setattr(linear, "ACTS", [Act("fp8"), None])  # another process: other Acts, in another order
    loaded = pickle.loads(data)
    assert [m.act for m in loaded] == [Act("int8", divisor=127.0)] * 2 and loaded[0].act_index == 1
    assert all(torch.equal(a, b) for a, b in zip([m(x) for m in loaded], expected))
    assert copy.deepcopy(loaded)[1].act == Act("int8", divisor=127.0)


def test_act_kind_checked():
    with pytest.raises(ValueError, match="Act.kind must be one of"):
        Act("int4")


@pytest.mark.parametrize("freezing", [False, True], ids=["plain", "freezing"])
def test_prepared_model_compiles_with_the_backend(bf16_model, freezing):
    """For real, one Inductor compile (CPU): the prepared model compiled with
    ``backend="fusepass"`` gives its eager logits (within the rounding of a different
    activation-quantization order), with every linear fused and siblings joined. Also with
    ``torch._inductor.config.freezing`` set while Dynamo traces: the rewrite runs before
    freezing would fold the weights' dequantization into float constants (``RewritePass``;
    after it no linear fused), and the compiled graph takes ``ids`` alone (the weights held)."""
    model, _ = _prepared(bf16_model, "int8")
    ids = models.prompt(bf16_model, 2, 8, seed=4)
    counters["fusepass"].clear()
    torch._dynamo.reset()
    inputs = []
    with torch.no_grad():
        eager = model(ids).logits
        with torch._inductor.config.patch(freezing=freezing, post_grad_custom_pre_pass=lambda g: inputs.append(
                len(g.find_nodes(op="placeholder")))):
            out = torch.compile(model, backend="fusepass", dynamic=False)(ids).logits
    assert dict(counters["fusepass"]) == {"dequant_mm": LINEARS, JOINED: 2 * SIZES.layers}
    assert (inputs == [1]) == freezing
    assert _rel(out, eager) < 0.05


def test_backend_name_registered_on_import_without_the_entry_point():
    """From a source tree (no installed entry point), ``import fusepass`` registers the name."""
    code = (
        "import importlib.metadata as md\n"
        "real = md.entry_points\n"
        "md.entry_points = lambda **kw: md.EntryPoints([]) if kw.get('group') == 'torch_dynamo_backends' else real(**kw)\n"
        "import torch, fusepass\n"
        "print(torch.compile(lambda x: x * 2, backend='fusepass')(torch.ones(2)).tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[2.0, 2.0]")


def _linear(act: Act, n: int = 256, k: int = 256, lo: int = 128, hi: int = 256):
    """Rows [lo, hi) of an (n, k) joint weight of ``act``'s scheme, with a bias."""
    from fusepass.integrations.linear import Joint, W8A8Linear

    g = torch.Generator().manual_seed(0)
    if act.kind.startswith("fp8"):
        weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n // 128, k // 128, generator=g) if act.kind == "fp8-block" else torch.rand(n, generator=g)
    colsum = weight.to(torch.int32).sum(1) if act.kind == "int8-asym" else None
    input_scale = torch.tensor(0.01) if act.kind == "fp8-static" else None
    return W8A8Linear(Joint(weight, scale / 100, colsum, torch.randn(n, generator=g), input_scale), lo, hi, act)


@pytest.mark.parametrize("act", [Act(kind) for kind in Act.KINDS] + [Act("fp8", ceiling=1.5)], ids=str)
def test_the_expanded_form_computes_the_eager_forward(act):
    """The forms the pass expands ``fusepass::w8a8_linear`` into (``passes.expand.EXPANSIONS``)
    against the forward on the ops, rows [128, 256) of a joint weight with a bias: the same
    product, to fp32's rounding (an amax ceiling below the rows' amax: FBGEMM's recipe, values
    clamped); and the node run as a call (another backend) is the forward itself."""
    from fusepass.integrations.linear import SOURCE
    from fusepass.passes.expand import EXPANSIONS

    lin, x = _linear(act), torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    j = lin.joint
    args = (x, j.weight, j.weight_scale, j.colsum, j.bias, j.input_scale, lin.lo, lin.hi, act.kind, act.divisor,
            act.floor, act.ceiling, SOURCE)
    op = torch.ops.fusepass.w8a8_linear.default
    forms = EXPANSIONS[op](*args)
    assert forms.shape == (2, 3, 128)
    torch.testing.assert_close(forms, lin(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(op(*args), lin(x), rtol=0, atol=0)
    torch.library.opcheck(op, args, test_utils="test_faketensor")


def test_dynamo_traces_a_prepared_linear_as_one_node(bf16_model):
    """One ``fusepass.w8a8_linear`` node a converted linear, and none of its ops, for Dynamo
    to trace (its compile time); the pass expands them (tests/passes/test_expand.py). (On torch
    2.11 this also checks that export is told by its flag: there ``is_exporting()`` is True under
    torch.compile.)"""
    model, prep = _prepared(bf16_model, "int8")
    graphs = []
    fn = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=False)
    with torch.no_grad():
        fn(models.prompt(bf16_model, 1, 4, seed=5))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("fusepass.w8a8_linear") for t in targets) == len(prep.converted) == LINEARS
    assert not [t for t in targets if "amax" in t or "_int_mm" in t], targets


def test_an_exported_prepared_model_holds_aten_ops_only(bf16_model):
    """Under torch.export the forward traces its ATen forms: a saved program needs no fusepass."""
    model, _ = _prepared(bf16_model, "int8")
    ep = torch.export.export(model, (models.prompt(bf16_model, 1, 4, seed=5),), {"use_cache": False})
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "fusepass" in t] and "aten.amax.default" in targets, targets


def test_a_prepared_module_prints_its_rows_and_scheme():
    assert repr(_linear(Act("fp8"))).startswith(
        "W8A8Linear(\n  in_features=256, out_features=128, act=fp8, rows=[128, 256) of 256")
