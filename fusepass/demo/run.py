"""``fusepass demo``: what fusepass does to a W8A8 Llama-style model, on this machine."""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch

# The backend object, not its name: the demo also runs from a source tree (no entry point).
from ..backend import fusepass_backend
from ..explain import explain
from ..ops.checks import MIN_FP8_CAPABILITY
from .model import Shape, build, quantize

# Defaults by device: a small model on CPU (Inductor compiles C++ there); on CUDA,
# Llama-3-8B-shaped layers.
CPU_DEFAULTS = dict(layers=2, dim=256, hidden=512, heads=4, kv_heads=2, tokens=32, decode_batch=4)
CUDA_DEFAULTS = dict(layers=2, dim=4096, hidden=14336, heads=32, kv_heads=8, tokens=2048, decode_batch=16)


@contextlib.contextmanager
def step(what: str):
    """Show a long step while it runs, and how long it took."""
    print(f"... {what}", end="", flush=True)
    t0 = time.perf_counter()
    yield
    print(f" done ({time.perf_counter() - t0:.1f} s)", flush=True)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _ms(fn, x) -> float:
    """Median ms of fn(x), timed with CUDA events after warm-up (triton.testing.do_bench,
    which also flushes L2 between calls)."""
    from triton.testing import do_bench

    return do_bench(lambda: fn(x), warmup=50, rep=300, return_mode="median")


@dataclass
class Timing:
    name: str
    prefill: float | None
    decode: float | None
    note: str = ""


def check_device(scheme: str, device: torch.device) -> None:
    """Raise SystemExit with a clear message where the scheme cannot run."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusepass demo: --device cuda given but no CUDA GPU is available")
    if scheme == "fp8":
        if device.type != "cuda":
            raise SystemExit("fusepass demo: --scheme fp8 needs a CUDA GPU (fp8 matmuls run on GPUs only); "
                             "use --scheme int8 or int8-azp on CPU")
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_FP8_CAPABILITY:
            raise SystemExit(f"fusepass demo: --scheme fp8 needs compute capability >= 8.9; {device} has {cap[0]}.{cap[1]}")


def run(scheme: str, device: torch.device, shape: Shape, tokens: int, decode_batch: int, seed: int) -> int:
    check_device(scheme, device)
    print(f"fusepass demo: {shape.layers}-layer Llama-style decoder (dim {shape.dim}, hidden {shape.hidden}, "
          f"{shape.heads} heads / {shape.kv_heads} kv), bf16, {scheme} W8A8, on {device}")
    with step("building the bf16 model and its quantized copy"):
        model = build(shape, device, seed=seed)
        qmodel = quantize(copy.deepcopy(model), scheme)
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(1, tokens, shape.dim, device=device, dtype=torch.bfloat16, generator=g)
        xd = torch.randn(decode_batch, 1, shape.dim, device=device, dtype=torch.bfloat16, generator=g)
    with step("tracing for the fusion report"):
        report = explain(qmodel, x)
    print(f"\nFusion report (prefill, {tokens} tokens):\n{report}\n")

    with torch.no_grad():
        with step("compiling with backend='fusepass' and running"):
            fused = torch.compile(qmodel, backend=fusepass_backend)
            out = fused(x)
        ref_q, ref_bf16 = qmodel(x), model(x)
    exact = copy.deepcopy(model).double()(x.double()) if device.type == "cpu" else None
    print("\nAccuracy (prefill output):")
    print(f"  fused vs eager quantized:  max abs {(out.float() - ref_q.float()).abs().max().item():.3g}, "
          f"rel {_rel(out, ref_q):.2e}")
    print(f"  fused vs bf16 model:       rel {_rel(out, ref_bf16):.2e}   (eager quantized vs bf16: {_rel(ref_q, ref_bf16):.2e})")
    if exact is not None:
        print(f"  vs float64 model:          fused {_rel(out, exact):.2e}, eager quantized {_rel(ref_q, exact):.2e}")
    print("  (compiled and eager runs round differently in between, and each layer re-quantizes its input,\n"
          "   so they drift apart by about the quantization error; both stay as close to the bf16 model)")
    if device.type == "cuda":
        _latency(model, qmodel, x, xd)
    ok = bool(report.decisions) and not report.left
    print("\nEvery quantized linear fused." if ok else f"\n{len(report.left)} quantized linear(s) left alone (see the report).")
    return 0


def _latency(model, qmodel, x, xd) -> None:
    """Prefill and decode latency of bf16 vs stock-compiled quantized vs fusepass."""
    variants = [("bf16, torch.compile", model, {}), ("W8A8, torch.compile", qmodel, {}),
                ("W8A8, fusepass", qmodel, {"backend": fusepass_backend})]
    rows = []
    with torch.no_grad():
        for name, m, kw in variants:
            times = {}
            for phase, inp, mode in (("prefill", x, None), ("decode", xd, "reduce-overhead")):
                with step(f"compiling and timing {name}, {phase} ({inp.shape[0] * inp.shape[1]} tokens"
                          f"{', CUDA graphs' if mode else ''})"):
                    torch._dynamo.reset()
                    try:
                        fn = torch.compile(m, mode=mode, **kw)
                        times[phase] = _ms(fn, inp)
                    except Exception as e:  # e.g. torch._int_mm has no path for M <= 16
                        times[phase] = None
                        times[phase + "_error"] = str(e).strip().splitlines()[0][:80]
            note = "; ".join(f"{p} fails: {times[p + '_error']}" for p in ("prefill", "decode") if times.get(p + "_error"))
            rows.append(Timing(name, times["prefill"], times["decode"], note))
    _print_table(rows, x, xd)


def _print_table(rows, x, xd) -> None:
    fmt = lambda v: "fails" if v is None else f"{v * 1000:.0f} us" if v < 1 else f"{v:.2f} ms"  # noqa: E731
    ours = rows[-1]

    def speedup(base, mine):
        return "-" if base is None or mine is None else f"{base / mine:.2f}x"

    print(f"\nLatency on {torch.cuda.get_device_name()} (median, CUDA events; decode with CUDA graphs):")
    print(f"| model | prefill ({x.shape[1]} tokens) | decode ({xd.shape[0]} tokens) | fusepass speedup prefill / decode |")
    print("|---|---|---|---|")
    for r in rows:
        sp = "-" if r is ours else f"{speedup(r.prefill, ours.prefill)} / {speedup(r.decode, ours.decode)}"
        print(f"| {r.name} | {fmt(r.prefill)} | {fmt(r.decode)} | {sp} |")
    for r in rows:
        if r.note:
            print(f"  {r.name}: {r.note}")
