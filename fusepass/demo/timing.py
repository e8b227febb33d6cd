"""The demo's speed table: prefill latency and decode tokens/s of the bf16 model, of the
quantized model under stock ``torch.compile`` and under fusepass, in default mode and with
CUDA graphs (``mode="reduce-overhead"``, CUDA only).

Each (model, mode) is compiled afresh (``dynamic=False``), then each step is called a few
times to warm up and timed call by call: CUDA events on a GPU (median), ``perf_counter``
on a CPU (median; labelled CPU). A step that raises is reported as failing, with why.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch

from .accuracy import short
from .models import decode_inputs, prefill_inputs, static_cache

MODES = {"default": None, "CUDA graphs": "reduce-overhead"}


@dataclass
class Result:
    """One (model, mode) row: seconds per call of each step, or why it failed."""

    model: str
    mode: str
    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Table:
    device: str  # e.g. "NVIDIA H100 80GB HBM3" or "CPU"
    prompt_len: int
    batches: tuple[int, ...]
    results: list[Result]

    @property
    def steps(self) -> list[str]:
        return ["prefill"] + [f"decode b{b}" for b in self.batches]


def _time_calls(call, device: torch.device, warmup: int, reps: int, graphs: bool) -> float:
    """Median seconds of one ``call()`` after ``warmup`` calls (the first compiles)."""
    times = []
    for i in range(warmup + reps):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            call()
            seconds = time.perf_counter() - t0
        if i >= warmup:
            times.append(seconds)
    return statistics.median(times)


def _step_call(fn, model, ids: torch.Tensor, label: str, max_len: int):
    """``fn`` on the inputs of step ``label`` ("prefill", or "decode b<batch>")."""
    if label == "prefill":
        inputs = prefill_inputs(ids[:1])
        return lambda: fn(**inputs)
    batch = int(label.split("b")[-1])
    cache = static_cache(model, batch, max_len)
    inputs = decode_inputs(ids[:batch], cache)
    calls = itertools.count(1)

    def call():
        if next(calls) % max_len == 0:  # empty the cache before it overflows (rarely: the median ignores it)
            cache.reset()
        return fn(**inputs)

    return call


def measure(variants, ids: torch.Tensor, batches: tuple[int, ...], max_len: int, step) -> Table:
    """Time ``variants`` (``[(name, model, torch.compile kwargs)]``) on the prefill of
    ``ids[:1]`` and on a decode step at each batch of ``batches`` (``ids`` has that many rows)."""
    device = ids.device
    cuda = device.type == "cuda"
    warmup, reps = (5, 20) if cuda else (2, 5)
    table = Table(torch.cuda.get_device_name(device) if cuda else "CPU", ids.shape[1], batches, [])
    with torch.no_grad():
        for name, model, kwargs in variants:
            for mode_name, mode in MODES.items() if cuda else [("default", None)]:
                res = Result(name, mode_name)
                table.results.append(res)
                torch.compiler.reset()
                fn = torch.compile(model, mode=mode, dynamic=False, **kwargs)
                for label in table.steps:
                    with step(f"compiling and timing {name}, {mode_name}: {label}") as note:
                        try:
                            call = _step_call(fn, model, ids, label, max_len)
                            res.seconds[label] = _time_calls(call, device, warmup, reps, mode == "reduce-overhead")
                        except Exception as e:  # e.g. torch._int_mm needs M > 16 on CUDA
                            res.errors[label] = short(e)
                        note["result"] = f"fails: {res.errors[label]}" if label in res.errors else _fmt(res, label, [])
    return table


def _fmt(res: Result, label: str, notes: list[str]) -> str:
    if label in res.errors:
        if res.errors[label] not in notes:
            notes.append(res.errors[label])
        return f"fails ({notes.index(res.errors[label]) + 1})"
    s = res.seconds[label]
    t = f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"
    if label == "prefill":
        return t
    return f"{int(label.split('b')[-1]) / s:,.0f} tok/s ({t})"


def format_table(table: Table, ours: str) -> str:
    """A markdown table, the failures' reasons, and the speedups of model ``ours``."""
    where = "CPU timings (perf_counter)" if table.device == "CPU" else f"{table.device} (CUDA events)"
    head = ["model", "mode", f"prefill ({table.prompt_len} tokens)"] + [f"decode batch {b}" for b in table.batches]
    lines = [f"Speed on {where}, median per call; decode: one new token per sequence with a static KV cache",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []
    for r in table.results:
        cells = [r.model, r.mode] + [_fmt(r, label, notes) for label in table.steps]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"  ({i}) {why}" for i, why in enumerate(notes, 1)]
    if table.device == "CPU":
        lines.append("  CPU: fusepass's CPU ops are its exact reference implementation, not fast kernels, "
                     "and bf16 matmuls may be slow on this CPU: these timings say nothing about a GPU's")
    for mine in [r for r in table.results if r.model == ours]:
        for base in table.results:
            if base.mode != mine.mode or base.model == mine.model:
                continue
            ratios = [f"{label} {base.seconds[label] / mine.seconds[label]:.2f}x" for label in table.steps
                      if label in base.seconds and label in mine.seconds]
            if ratios:
                lines.append(f"{ours} speedup over {base.model} ({mine.mode}): {', '.join(ratios)}")
    return "\n".join(lines)
