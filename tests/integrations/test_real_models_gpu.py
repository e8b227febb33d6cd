"""Real clients on the GPU: a transformers Llama at Llama-3-8B layer sizes, quantized by
torchao (int8 symmetric, int8 asymmetric, fp8 per-row), compiled with ``backend="fusepass"``
for real, greedy ``generate`` with a static cache at batch 1 and 16.

For each: every quantized linear of the decode graph fuses (fp8 prefill, M > 16, stays on
cuBLAS by the measured fp8 policy), the compiled model's logits are no further from the
float model than eager torchao's, and the greedy tokens equal eager's or differ first at a
near-tie of eager's own logits. The CPU versions, small: test_real_models.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fusepass import PassConfig
from fusepass.backend import fusepass_backend
from fusepass.passes.group import NAME as GROUPED
from fusepass.passes.route import ROUTED
from fusepass.passes.share import NAME as SHARED

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
pytest.importorskip("torchao")
from fusepass.demo import accuracy, models  # noqa: E402

# Llama-3-8B's layer (hidden 4096, MLP 14336, 32 heads / 8 kv heads); one layer and a small
# vocabulary keep each compile short.
SIZES = models.Sizes(layers=1, hidden_size=4096, intermediate_size=14336, heads=32, kv_heads=8, vocab_size=1024)
LINEARS = 7 * SIZES.layers + 1  # q k v o gate up down per layer, lm_head
PROMPT, NEW = 32, 8
# The patterns each torchao config's linears match (torchao 0.17 dequantizes asymmetric
# activations before a bf16 mm, 0.18 takes _int_mm), and whether the prefill (M = 32 *
# batch) fuses at every batch: fp8 fuses at M <= PassConfig.fp8_max_m only.
EXPECT = {"int8": (("int_mm_scaled",), True), "int8-asym": (("int_mm_azp_per_token", "dequant_mm"), True),
          "fp8": (("scaled_mm_fp8_direct", "scaled_mm_fp8_epilogue"), False)}


@pytest.fixture(scope="module")
def bf16_model():
    return models.random_llama(SIZES, PROMPT + NEW, torch.device("cuda"), seed=0)


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _assert_same_tokens_or_near_tie(fused: accuracy.Run, eager: accuracy.Run):
    if torch.equal(fused.tokens, eager.tokens):
        return
    step = int((fused.tokens != eager.tokens).nonzero()[0])
    logits = lambda r: r.prefill_logits[-1] if step == 0 else r.decode_logits[step - 1]  # noqa: E731
    top2 = logits(eager).topk(2).values
    assert top2[0] - top2[1] <= 2 * (logits(fused) - logits(eager)).abs().max(), f"token {step} differs, no near-tie"


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("quant", list(EXPECT))
def test_torchao_llama_generates_fused(bf16_model, quant, batch):
    if quant == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    patterns, prefill_fuses = EXPECT[quant]
    qmodel = models.quantized_copy(bf16_model, quant, "torchao")
    ids = models.prompt(bf16_model, batch, PROMPT, seed=batch)
    counters["fusepass"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        fused = accuracy.greedy("fused", qmodel, ids, NEW, fusepass_backend)
    assert not fused.error, fused.error
    found = dict(counters["fusepass"])
    assert ROUTED not in found, found
    # the decode graph's q/k/v: one launch (zero-point ops, int8-asym's, are not grouped)
    assert (found.pop(GROUPED, 0) >= 1) == (quant != "int8-asym"), found
    found.pop(SHARED, 0)  # (calls that read an earlier copy of their quantized input: not a fusion)
    prefill_fuses = prefill_fuses or PROMPT * batch <= PassConfig().fp8_max_m
    graphs = 2 if prefill_fuses else 1  # prefill and decode
    assert sum(found.values()) == graphs * LINEARS and set(found) <= set(patterns), found

    eager = accuracy.greedy("eager", qmodel, ids, NEW)
    assert not eager.error, eager.error
    _assert_same_tokens_or_near_tie(fused, eager)
    # Logits of row 0 over the prompt and the compiled run's tokens, against the float model.
    reference = accuracy.forced_logits(bf16_model.float(), ids, fused.tokens)
    bf16_model.bfloat16()
    ours = torch.cat([fused.prefill_logits, fused.decode_logits])
    theirs = accuracy.forced_logits(qmodel, ids, fused.tokens)
    assert _rel(ours, reference) <= 1.1 * _rel(theirs, reference) + 1e-3, (_rel(ours, reference), _rel(theirs, reference))


# What a prepared model's linears match: fusepass.prepare's compile-time forms (integrations/linear.py).
PREPARED = {"int8": {"dequant_mm"}, "int8-asym": {"int_mm_azp_per_token"}, "fp8": {"dequant_mm"}}


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("quant", list(PREPARED))
def test_prepared_llama_generates_fused(bf16_model, quant, batch):
    """``fusepass.prepare`` on a torchao model, then ``backend="fusepass"``: every quantized
    linear fused at prefill and decode, q/k/v and gate/up joined, tokens and logits as eager
    torchao's (the policy above)."""
    import fusepass
    from fusepass.passes.join import NAME as JOINED
    from fusepass.passes.quantize_in import NAME as QUANTIZED_IN

    if quant == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    qmodel = models.quantized_copy(bf16_model, quant, "torchao")
    ids = models.prompt(bf16_model, batch, PROMPT, seed=batch)
    eager = accuracy.greedy("eager", qmodel, ids, NEW)  # (torchao's own, before prepare)
    assert not eager.error, eager.error
    theirs = accuracy.forced_logits(qmodel, ids, eager.tokens)
    report = fusepass.prepare(qmodel)
    assert len(report.converted) == LINEARS and not report.left, report
    counters["fusepass"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        fused = accuracy.greedy("fused", qmodel, ids, NEW, fusepass_backend)
    assert not fused.error, fused.error
    found = dict(counters["fusepass"])
    # prefill and decode: 7 linears a layer and lm_head each; q/k/v and gate/up joined
    joined = found.pop(JOINED, 0)
    # (outside CUDA graphs, the decode graph's o_proj and down_proj rows quantized in their M = 1 launches)
    assert found.pop(QUANTIZED_IN, 0) == (2 * SIZES.layers if quant in ("int8", "fp8") and batch == 1 else 0), found
    assert set(found) <= PREPARED[quant] and sum(found.values()) == 2 * LINEARS, found
    assert joined == 2 * 2 * SIZES.layers, (joined, found)
    _assert_same_tokens_or_near_tie(fused, eager)
    reference = accuracy.forced_logits(bf16_model.float(), ids, eager.tokens)
    bf16_model.bfloat16()
    ours = accuracy.forced_logits(qmodel, ids, eager.tokens)  # (prepared, eager: fusepass's kernels)
    assert _rel(ours, reference) <= 1.1 * _rel(theirs, reference) + 1e-3, (_rel(ours, reference), _rel(theirs, reference))
