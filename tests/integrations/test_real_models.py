"""Real clients: Hugging Face transformers models quantized by torchao, compiled with fusepass.

Random-init small configs of two architectures (Llama; Qwen2, which adds q/k/v biases)
with torchao's int8 dynamic quantization, symmetric and asymmetric activations. For each,
at batch 1 and 4, in the prefill graph and in the one-token decode graph of a static KV
cache: every quantized linear fuses (whole, or in part with the reason), the logits stay
within the numerics policy, and greedy ``generate`` with a static cache gives eager's
tokens (or differs only at a near-tie of eager's own logits).

The pass runs on the graph Inductor would give it, and the graph then runs eagerly
(``capture_backend``): no C++ compile per graph. One test compiles for real, with
``backend="fusepass"``. The GPU versions, at Llama-3-8B layer sizes: test_real_models_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from fusepass.backend import capture_backend, fusepass_backend
from fusepass.passes import FusePass

transformers = pytest.importorskip("transformers")
torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
# Config, its arguments, and the patterns its linears match: torchao >= 0.18 runs asymmetric
# activations through _int_mm, 0.17 (the GPU machine's) dequantizes them before a bf16 mm.
QUANT = {
    "int8": (Int8DynamicActivationInt8WeightConfig, {}, ("int_mm_scaled",)),
    "int8-asym": (Int8DynamicActivationInt8WeightConfig, {"act_mapping_type": MappingType.ASYMMETRIC},
                  ("int_mm_azp_per_token", "dequant_mm")),
}
PROMPT, NEW = 8, 6


def build(arch: str, quant: str | None, seed: int = 0):
    """A random-init model in bf16, torchao-quantized unless ``quant`` is None."""
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SIZES)).eval().to(torch.bfloat16)
    if quant is not None:
        cfg, kwargs, _ = QUANT[quant]
        quantize_(model, cfg(**kwargs))
    return model


def run_fused(fn, *args):
    """``fn(*args)`` with the pass on its graphs; returns (output, decisions)."""
    decisions, pass_ = [], FusePass()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=capture_backend(lambda gm: decisions.extend(pass_.run(gm.graph))))
    with torch.no_grad():
        return compiled(*args), decisions


def steps(model, batch: int):
    """The prefill and the one-token decode step of a static cache, as functions of ids."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW)

    def prefill(ids):
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits

    def decode(ids):
        pos = torch.tensor([PROMPT])
        return model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, SIZES["vocab_size"], (batch, PROMPT + 1), generator=g)
    return (prefill, ids[:, :PROMPT]), (decode, ids[:, PROMPT:])


def rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("quant", list(QUANT))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_fuses_and_logits_keep_the_policy(arch, quant):
    patterns = QUANT[quant][2]
    model, reference = build(arch, quant), build(arch, None).float()
    n_linears = 7 * SIZES["num_hidden_layers"] + 1  # q k v o gate up down per layer, lm_head
    for batch in (1, 4):
        fused_steps, eager_steps, ref_steps = steps(model, batch), steps(model, batch), steps(reference, batch)
        for (fn, ids), (eager_fn, _), (ref_fn, _) in zip(fused_steps, eager_steps, ref_steps):
            out, decisions = run_fused(fn, ids)
            where = f"{arch} {quant} batch {batch} {fn.__name__}"
            assert len(decisions) == n_linears, where
            assert all(d.fused and d.pattern in patterns for d in decisions), (where, decisions)
            assert len({d.pattern for d in decisions}) == 1, decisions
            assert all(d.module and "L['" not in d.module for d in decisions), decisions
            with torch.no_grad():
                eager, ref = eager_fn(ids), ref_fn(ids)
            # The fused graph rounds less in between: no further from the float model
            # than eager torchao is (each layer re-quantizes, so compare distances).
            assert rel(out, ref) <= 1.1 * rel(eager, ref) + 1e-3, (where, rel(out, ref), rel(eager, ref))


def _generate(model, ids, forward=None):
    if forward is not None:
        model.forward = forward
    try:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                                  output_logits=True, return_dict_in_generate=True)
    finally:
        model.__dict__.pop("forward", None)


def assert_same_tokens_or_near_tie(fused, eager):
    """Greedy tokens equal eager's; where they differ, eager's own top two logits at the
    first differing step are closer than the fused logits are to eager's there."""
    if torch.equal(fused.sequences, eager.sequences):
        return
    new = fused.sequences.shape[1] - len(fused.logits)
    step = int((fused.sequences != eager.sequences).any(0).nonzero()[0]) - new
    row = int((fused.sequences[:, new + step] != eager.sequences[:, new + step]).nonzero()[0])
    top2 = eager.logits[step][row].float().topk(2).values
    diff = (fused.logits[step][row].float() - eager.logits[step][row].float()).abs().max()
    assert top2[0] - top2[1] <= 2 * diff, f"token {step} of row {row} differs without a near-tie"


@pytest.mark.parametrize("arch,quant", [("llama", "int8"), ("qwen2", "int8-asym")])
def test_greedy_generate_with_a_static_cache_matches_eager(arch, quant):
    model = build(arch, quant)
    ids = torch.randint(0, SIZES["vocab_size"], (4, PROMPT), generator=torch.Generator().manual_seed(7))
    for batch in (1, 4):
        eager = _generate(model, ids[:batch])
        decisions, pass_ = [], FusePass()
        torch._dynamo.reset()
        forward = torch.compile(model.forward, backend=capture_backend(lambda gm: decisions.extend(pass_.run(gm.graph))))
        fused = _generate(model, ids[:batch], forward)
        assert decisions and all(d.fused for d in decisions), decisions
        assert_same_tokens_or_near_tie(fused, eager)


def test_backend_compiles_and_generates_at_batch_1():
    """The real path: Inductor compiles the lowered fused ops (CPU: C++ kernels)."""
    model = build("llama", "int8")
    ids = torch.randint(0, SIZES["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(3))
    eager = _generate(model, ids)
    torch._dynamo.reset()
    fused = _generate(model, ids, torch.compile(model.forward, backend=fusepass_backend))
    assert_same_tokens_or_near_tie(fused, eager)
