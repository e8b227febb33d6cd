"""The demo's accuracy check: greedy generation with a static cache, compiled with fusepass
and eager, and the compiled model's logits against the bf16 model's, next to eager's."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class Run:
    """One greedy generation: its new tokens, and the logits the model computed (fp32):
    the prefill's, every prompt position, and each decode step's (the last token's none)."""

    name: str
    tokens: torch.Tensor | None = None  # [new_tokens]
    prefill_logits: torch.Tensor | None = None  # [prompt, vocab]
    decode_logits: torch.Tensor | None = None  # [new_tokens - 1, vocab]
    error: str = ""


def short(e: BaseException) -> str:
    """The first line of an exception, short enough for a table."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:160]


def greedy(name: str, model, ids: torch.Tensor, new_tokens: int, backend=None, compile_prefill: bool = True) -> Run:
    """``model.generate(ids, do_sample=False, cache_implementation="static")`` for
    ``new_tokens`` tokens, recording the logits of every forward. ``backend``: the forward is
    compiled with it (``dynamic=False``) for the decode steps, and for the prefill too if
    ``compile_prefill``; else all eager. An exception is kept in ``Run.error``, not raised."""
    run = Run(name)
    forward = model.forward
    compiled = torch.compile(forward, backend=backend, dynamic=False) if backend is not None else forward
    logits = []

    @functools.wraps(forward)
    def recording(*args, **kwargs):
        decode = kwargs["input_ids"].shape[1] == 1 and bool(logits)
        out = (compiled if decode or compile_prefill else forward)(*args, **kwargs)
        logits.append(out.logits[0].float().clone())
        return out

    torch.compiler.reset()
    model.forward = recording  # generate calls the model, hence the compiled forward
    try:
        with torch.no_grad():
            seq = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, cache_implementation="static", disable_compile=True,
                logits_to_keep=0,  # the prefill's logits at every position, not just the last
                pad_token_id=model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0)
        run.tokens = seq[0, ids.shape[1]:].cpu()
        run.prefill_logits = logits[0]
        run.decode_logits = torch.cat([x[-1:] for x in logits[1:]]) if len(logits) > 1 else None
    except Exception as e:  # e.g. torch._int_mm needs M > 16 on CUDA (eager hand-written int8 at decode)
        run.error = short(e)
    finally:
        del model.forward
    return run


def forced_logits(model, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The eager model's logits [prompt + len(tokens) - 1, vocab] over the prompt followed by
    ``tokens`` (teacher-forced: every position predicts the next, given the same context)."""
    seq = torch.cat([ids[0], tokens.to(ids.device)])[None, :-1]
    with torch.no_grad():
        return model(input_ids=seq, use_cache=False).logits[0].float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _compare(a: torch.Tensor, ref: torch.Tensor) -> str:
    agree, n = int((a.argmax(-1) == ref.argmax(-1)).sum()), ref.shape[0]
    return f"relative error {_rel(a, ref):.2e}, top-1 agreement {agree}/{n} ({100 * agree / n:.0f}%)"


def _agree(a: Run, b: Run) -> str:
    """How many of the greedy tokens agree, up to the first that differs (after which the
    two runs continue from different contexts)."""
    if a.tokens is None or b.tokens is None:
        failed = a if a.tokens is None else b
        return f"n/a ({failed.name} failed: {failed.error})"
    same = (a.tokens == b.tokens).tolist()
    n = same.index(False) if False in same else len(same)
    return f"{n}/{len(same)} tokens agree" + ("" if n == len(same) else f" (then token {n + 1} differs)")


def format_accuracy(fused: Run, eager: Run, bf16: Run, ref_q: torch.Tensor | None, ref_bf16: torch.Tensor | None,
                    prompt_len: int, new_tokens: int, prefill_compiled: bool) -> str:
    """The compiled model's logits vs the bf16 model's, next to eager quantized vs bf16 on
    the same tokens, and the greedy tokens' agreement. ``ref_q`` / ``ref_bf16``:
    forced_logits of the eager quantized / bf16 model on the compiled run's tokens."""
    if fused.error or ref_q is None or ref_bf16 is None:
        lines = [f"Accuracy: the fusepass-compiled run failed: {fused.error}"]
    else:
        lines = ["Accuracy: logits vs the bf16 model's, on the fusepass-compiled run's tokens"]
        parts = []
        if prefill_compiled:
            parts.append((f"prefill ({prompt_len} positions)", fused.prefill_logits, slice(0, prompt_len)))
        if fused.decode_logits is not None:
            n = fused.decode_logits.shape[0]
            parts.append((f"decode ({n} step{'s' * (n > 1)})", fused.decode_logits, slice(prompt_len, prompt_len + n)))
        for label, logits, where in parts:
            lines.append(f"  {label}:")
            lines.append(f"    {fused.name:<20} {_compare(logits, ref_bf16[where])}")
            lines.append(f"    {eager.name:<20} {_compare(ref_q[where], ref_bf16[where])}")
    lines.append(f"Greedy generation: {new_tokens} new token{'s' * (new_tokens > 1)}, "
                 'model.generate(do_sample=False, cache_implementation="static")')
    lines.append(f"  {fused.name} vs {eager.name}: {_agree(fused, eager)}")
    lines.append(f"  vs the bf16 model's tokens: {fused.name} {_agree(fused, bf16)}; "
                 f"{eager.name} {_agree(eager, bf16)}")
    return "\n".join(lines)
