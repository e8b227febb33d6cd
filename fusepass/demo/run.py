"""``fusepass demo``: what fusepass does to a W8A8 transformers model, on this machine.

Builds (or loads) a causal LM in bf16 and its W8A8 copy, then reports: what each quantized
linear became in the prefill and decode graphs (``fusepass.explain``), the logits of the
fusepass-compiled model against bf16 next to eager's, greedy-token agreement, and (on
CUDA, or with ``--speed``) the speed table, optionally as a PNG (``--plot``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch

# The backend object, not its name: the demo also runs from a source tree (no entry point).
from ..backend import fusepass_backend
from ..integrations import prepare
from . import models


@dataclass
class Options:
    device: torch.device
    model: str | None  # a checkpoint (directory or hub id); None: random, of ``sizes``
    sizes: models.Sizes | None
    quant: str  # fusepass_cli.QUANTS
    quantizer: str  # fusepass_cli.QUANTIZERS
    prompt_len: int
    new_tokens: int
    batch: int
    speed: bool
    plot: str | None
    seed: int = 0
    verbose: bool = False


@contextlib.contextmanager
def step(what: str):
    """Show a long step while it runs, how long it took, and what the step put in the
    dict it is given under "result" (a measurement, say)."""
    print(f"... {what}", end="", flush=True)
    t0 = time.perf_counter()
    note: dict = {}
    try:
        yield note
    except BaseException:
        print(" failed", flush=True)
        raise
    result = f": {note['result']}" if "result" in note else ""
    print(f" done ({time.perf_counter() - t0:.1f} s){result}", flush=True)


def run(o: Options) -> int:
    """The whole demo; 0 if the fusepass-compiled model ran and the pass saw its quantized
    matmuls, else 1."""
    with warnings.catch_warnings():
        # torchao's tensor subclasses have no stable hash: AOTAutograd's cache says so once a graph.
        warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
        # torchao 0.17 warns of its own deprecated classes at each quantize and trace.
        warnings.filterwarnings("ignore", message="Deprecation: ", category=UserWarning)
        warnings.filterwarnings("ignore", category=SyntaxWarning)  # (torchao 0.17 docstrings, at import)
        model, qmodel, fmodel, ids = _build(o)
        reports = _fusion(o, fmodel, ids)
        ok = _accuracy(o, model, qmodel, fmodel, ids[:1])
        if o.speed:
            _speed(o, model, qmodel, fmodel, ids)
    decisions = [d for r in reports.values() for d in r.decisions]
    partial = sum(bool(getattr(d, "partial", False)) for d in decisions)
    if not decisions:  # (a quantized model whose matmuls the pass never saw: graph breaks, say)
        print("No quantized matmul reached the fusion pass in any graph: nothing was fused.")
        return 1
    if all(d.fused for d in decisions):
        print("Every quantized linear fused in every graph"
              + (f" ({partial} in part, see why above)." if partial else "."))
    else:
        print(f"{sum(not d.fused for d in decisions)} of {len(decisions)} quantized matmuls (all graphs) left alone: "
              "see the fusion report.")
    return 0 if ok else 1


def _batches(o: Options) -> tuple[int, ...]:
    return (1,) if o.batch == 1 else (1, o.batch)


def _build(o: Options):
    """The bf16 model, its W8A8 copy as the user has it (run eagerly and by stock
    torch.compile), the same made ready for fusepass (``fusepass.prepare``: the model the
    demo compiles with the backend; the hand-written linears need nothing), and random
    prompts [batch, prompt_len]. A compressed-tensors checkpoint is its own W8A8 model; its
    bf16 model is the checkpoint dequantized."""
    checkpoint = o.model is not None and models.prequantized(o.model)
    with step("importing transformers" + " and torchao" * (o.quantizer == "torchao" and not checkpoint)), \
            models.quiet_imports():
        if o.quantizer == "torchao" and not checkpoint:
            import torchao  # noqa: F401
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    with step("building the bf16 model and its W8A8 copies") as note, models.quiet_imports():
        if checkpoint:
            model = models.load_pretrained(o.model, o.device, dequantize=True)
            qmodel, fmodel = (models.load_pretrained(o.model, o.device) for _ in range(2))
        else:
            model = (models.random_llama(o.sizes, o.prompt_len + o.new_tokens, o.device, o.seed) if o.model is None
                     else models.load_pretrained(o.model, o.device))
            qmodel = models.quantized_copy(model, o.quant, o.quantizer)
            fmodel = (qmodel if o.quantizer == "handwritten"
                      else models.quantized_copy(model, o.quant, o.quantizer))
        if fmodel is not qmodel:
            report = prepare(fmodel)
            note["result"] = str(report).splitlines()[0]
            if checkpoint and not report.converted:
                why = ("; transformers loads a native FP8 checkpoint quantized only on a GPU of compute capability "
                       "8.9 or more (elsewhere it dequantizes it)") if checkpoint == "fp8" else ""
                raise SystemExit(f"fusepass demo: --model {o.model}: no quantized linear it runs ({report}){why}")
        ids = models.prompt(model, o.batch, o.prompt_len, o.seed)
    if checkpoint:
        how = f"the checkpoint's own ({checkpoint}; the bf16 model: its weights dequantized)"
    elif o.quantizer == "torchao":
        how = f"quantized by torchao {models.TORCHAO_CONFIGS[o.quant]}"
    else:
        how = "quantized by the hand-written QuantLinear (fusepass/demo/handwritten.py)"
    source = "random weights from a config" if o.model is None else o.model
    quant = "" if checkpoint else f" {o.quant}"
    print(f"\nfusepass demo on {o.device}: {models.describe(model)} ({source}), bf16;\n"
          f"W8A8{quant}: every linear {how}\n")
    return model, qmodel, fmodel, ids


def _fusion(o: Options, qmodel, ids):
    """``fusepass.explain`` on the prefill and decode graphs, at batch 1 and ``o.batch``."""
    from .fusion import explain_steps, format_reports

    max_len = o.prompt_len + o.new_tokens
    steps = {f"prefill b{b}": models.prefill_inputs(ids[:b]) for b in _batches(o)}
    steps.update({f"decode b{b}": models.decode_inputs(ids[:b], models.static_cache(qmodel, b, max_len))
                  for b in _batches(o)})
    reports = explain_steps(qmodel, steps, step)
    print(f"\nFusion report (fusepass.explain; prefill: the {o.prompt_len}-token prompt; decode: one token, "
          f"with a static KV cache; b: sequences):\n{format_reports(reports, o.verbose)}\n")
    return reports


def _accuracy(o: Options, model, qmodel, fmodel, prompt) -> bool:
    """Greedy generation of ``fmodel`` compiled with fusepass, of ``qmodel`` eager and of
    bf16; the compiled model's logits vs bf16's next to eager's. False if the compiled run
    failed."""
    from .accuracy import forced_logits, format_accuracy, greedy

    # Inductor compiles C++ on a CPU, slowly: there only the decode step (the graph generate
    # runs new_tokens - 1 times) is compiled; on CUDA the prefill too.
    compile_prefill = o.device.type == "cuda"
    what = "prefill and decode" if compile_prefill else "the decode step"
    with step(f"greedy generation, {o.new_tokens} token{'s' * (o.new_tokens > 1)}: compiling with "
              f"backend=fusepass ({what})"):
        fused = greedy("fusepass-compiled", fmodel, prompt, o.new_tokens, fusepass_backend, compile_prefill)
    with step("greedy generation: eager quantized and bf16 models") as note:
        eager = greedy("eager quantized", qmodel, prompt, o.new_tokens)
        if eager.error:  # (a checkpoint's own modules that cannot run here: FP8Linear without `kernels`)
            note["result"] = f"the checkpoint's own eager model failed ({eager.error}): the prepared one's instead"
            qmodel, eager = fmodel, greedy("prepared, eager", fmodel, prompt, o.new_tokens)
        bf16 = greedy("bf16", model, prompt, o.new_tokens)
        ref_q = ref_bf16 = None
        if fused.tokens is not None:  # the references read the compiled run's tokens
            ref_q, ref_bf16 = forced_logits(qmodel, prompt, fused.tokens), forced_logits(model, prompt, fused.tokens)
    report = format_accuracy(fused, eager, bf16, ref_q, ref_bf16, o.prompt_len, o.new_tokens, compile_prefill)
    print(f"\n{report}\n")
    return not fused.error


def _speed(o: Options, model, qmodel, fmodel, ids) -> None:
    """The speed table (and its plot): bf16, stock torch.compile and fusepass."""
    from .timing import format_table, measure

    checkpoint = o.model is not None and models.prequantized(o.model)
    quant = "W8A8 (checkpoint)" if checkpoint else f"W8A8 {o.quant} ({o.quantizer})"
    ours = f"{quant}, fusepass"
    variants = [("bf16, torch.compile", model, {}), (f"{quant}, torch.compile", qmodel, {}),
                (ours, fmodel, {"backend": fusepass_backend})]
    table = measure(variants, ids, _batches(o), o.prompt_len + o.new_tokens, step)
    print(f"\n{format_table(table, ours)}\n")
    if o.plot:
        from .plot import plot

        plot(table, f"fusepass demo: {models.describe(qmodel)}, {quant}", o.plot)
        print(f"wrote {o.plot}\n")
