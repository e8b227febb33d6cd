"""W8A8 checkpoints in the compressed-tensors format (most W8A8 checkpoints on the hub): written
by compressed-tensors itself (``ct_checkpoints.py``), loaded by ``from_pretrained``, then
``fusepass.prepare``. For each scheme llm-compressor writes for W8A8 (int8 "W8A8", int8 with
asymmetric activations, "FP8_DYNAMIC", "FP8_BLOCK"): the checkpoint's own int8 / fp8 values kept, before
and after the model's first forward; no graph break left; every quantized linear fused at
prefill and decode, batch 1 and 4; logits within the numerics policy against the checkpoint's
own eager model and the float one; greedy generate as eager's (or a near-tie). Other schemes
are left as they are, named, and still run as before.
"""

from __future__ import annotations

import pytest
import torch

import fusepass
from fusepass.backend import fusepass_backend
from fusepass.passes.join import NAME as JOINED
from fusepass.passes.quantize_in import GROUPS_NAME as QUANTIZED_GROUPS_IN, NAME as QUANTIZED_IN

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")
from fusepass.demo import accuracy, models  # noqa: E402
from tests.support import ct_checkpoints as ct  # noqa: E402
from tests.support.helpers import prepared_step_decisions  # noqa: E402

KIND = {"W8A8": "int8", "W8A8_ASYM": "int8-asym", "FP8_DYNAMIC": "fp8", "FP8_BLOCK": "fp8-block"}
PATTERNS = {"int8": {"dequant_mm"}, "int8-asym": {"int_mm_azp_per_token"},
            "fp8": {"dequant_mm"}, "fp8-block": {"dequant_mm_blockwise"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    return {name: ct.build(root, name) for name in ct.SCHEMES}


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("first_forward", [False, True], ids=["as-loaded", "after-a-forward"])
@pytest.mark.parametrize("scheme", list(KIND))
def test_prepare_keeps_the_checkpoints_values(checkpoints, scheme, first_forward):
    path, _ = checkpoints[scheme]
    loaded = ct.load(path)
    k = loaded.model.layers[0].self_attn.k_proj
    stored = k.weight.detach().clone()  # (as loaded: the checkpoint's int8 / fp8 tensor)
    assert stored.dtype == (torch.float8_e4m3fn if scheme.startswith("FP8") else torch.int8)
    scale = k.weight_scale.detach().float()  # (N, 1), or per 128x128 block
    scale = scale if scheme == "FP8_BLOCK" else scale.flatten()
    model = ct.load(path)
    ids = models.prompt(model, 2, 8, seed=0)
    if first_forward:  # (compressed-tensors decompresses every weight and offloads every module)
        with torch.no_grad():
            model(ids)
        assert model.model.layers[0].self_attn.k_proj.weight.dtype == torch.bfloat16
    report = fusepass.prepare(model)
    assert set(report.converted.values()) == {KIND[scheme]} and len(report.converted) == ct.QUANTIZED_LINEARS
    assert not report.left
    new = model.model.layers[0].self_attn.k_proj
    assert isinstance(new, fusepass.W8A8Linear)
    assert torch.equal(new.joint.weight[new.lo:new.hi].view(torch.int8), stored.view(torch.int8))
    blocks = slice(new.lo // 128, new.hi // 128) if scheme == "FP8_BLOCK" else slice(new.lo, new.hi)
    assert torch.equal(new.joint.weight_scale[blocks], scale)
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("scheme", list(KIND))
def test_prepared_checkpoint_logits_within_policy(checkpoints, scheme):
    path, float_path = checkpoints[scheme]
    ids = models.prompt(ct.load(float_path), 2, 8, seed=1)
    with torch.no_grad():
        reference = ct.load(float_path).float()(ids).logits
        theirs = ct.load(path)(ids).logits  # compressed-tensors' own eager forward
        model = ct.load(path)
        fusepass.prepare(model)
        ours = model(ids).logits
    assert torch.isfinite(ours).all()
    assert _rel(ours, reference) <= 1.1 * _rel(theirs, reference) + 1e-3, (_rel(ours, reference), _rel(theirs, reference))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("scheme", list(KIND))
def test_every_quantized_linear_fuses(checkpoints, scheme, step, batch, device):
    decisions, found = prepared_step_decisions(ct.load(checkpoints[scheme][0]).to(device), step, batch)
    assert len(decisions) == ct.QUANTIZED_LINEARS and all(d.fused for d in decisions), decisions
    joined = found.pop(JOINED, 0)
    # (outside CUDA graphs, each o_proj's and down_proj's symmetric int8 or fp8 row quantized in its M = 1 launch)
    in_gemv = 2 * ct.SIZES["num_hidden_layers"] if scheme in ("W8A8", "FP8_DYNAMIC") and (step, batch) == ("decode", 1) else 0
    assert found.pop(QUANTIZED_IN, 0) == in_gemv, found
    # (FP8_BLOCK at decode b1: each block-wise launch quantizes its row's 128-wide groups)
    in_groups = 4 * ct.SIZES["num_hidden_layers"] if scheme == "FP8_BLOCK" and (step, batch) == ("decode", 1) else 0
    assert found.pop(QUANTIZED_GROUPS_IN, 0) == in_groups, found
    assert set(found) <= PATTERNS[KIND[scheme]] and sum(found.values()) == ct.QUANTIZED_LINEARS, found
    assert joined == 2 * ct.SIZES["num_hidden_layers"], (joined, found)  # (q/k/v and gate/up)


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_generate_compiled_as_eager(checkpoints, scheme):
    """For real (Inductor's C++ on the CPU): greedy generate with a static cache, prefill and
    decode compiled with ``backend="fusepass"``, gives the prepared model's eager tokens, or
    differs first at a near-tie of its logits."""
    model = ct.load(checkpoints[scheme][0])
    fusepass.prepare(model)
    ids = models.prompt(model, 1, 8, seed=3)
    eager = accuracy.greedy("eager", model, ids, 4)
    fused = accuracy.greedy("fused", model, ids, 4, fusepass_backend)
    assert not eager.error and not fused.error, (eager.error, fused.error)
    if not torch.equal(fused.tokens, eager.tokens):
        step = int((fused.tokens != eager.tokens).nonzero()[0])
        logits = (lambda r: r.prefill_logits[-1] if step == 0 else r.decode_logits[step - 1])
        top2 = logits(eager).topk(2).values
        assert top2[0] - top2[1] <= 2 * (logits(fused) - logits(eager)).abs().max(), f"token {step} differs, no near-tie"


def test_other_schemes_are_left_named_and_still_run(checkpoints):
    path, _ = checkpoints["W8A16"]
    ids = models.prompt(ct.load(path), 2, 8, seed=4)
    with torch.no_grad():
        theirs = ct.load(path)(ids).logits
    model = ct.load(path)
    report = fusepass.prepare(model)
    assert not report.converted and len(report.left) == ct.QUANTIZED_LINEARS
    assert all(why.startswith("compressed-tensors weights int8 per group, activations none: not W8A8")
               for why in report.left.values()), report.left
    with torch.no_grad():
        assert torch.equal(model(ids).logits, theirs)
