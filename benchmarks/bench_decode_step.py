"""A decode step outside CUDA graphs, taken apart: wall time, CUDA kernels and GPU time per step.

    python benchmarks/bench_decode_step.py                    # 4 Llama-3-8B layers, batch 1
    python benchmarks/bench_decode_step.py --batch 16 --variants bf16,int8-handwritten
    python benchmarks/bench_decode_step.py --split-outside-graphs   # fusepass rows split K (run 8)

Default ``torch.compile`` runs a decode step launch by launch, so the step is bound by the host
when the GPU work is short, and a fused model wins only if it also launches no more kernels
(``benchmarks/NOTES.md``, runs 8 and 9). Each variant is the demo's random transformers
``LlamaForCausalLM`` (``fusepass/demo/models.py``), quantized by torchao or by hand, compiled
with ``dynamic=False`` in default mode, and called on one decode step with a static KV cache
(reset before each step). The variants are timed in ``--rounds`` alternated rounds (median of
``--steps`` steps after 3, ``perf_counter`` around the step and a synchronize), so the host's
drift reaches every variant alike. ``torch.profiler`` then takes 5 steps: the host's time
under the profiler, and on CUDA the kernels by family and their GPU time (``--profile-dir``
keeps its tables). Writes ``results/<gpu>-<date>-decode-step.json`` (``-b16.json`` at
``--batch 16``).

``--split-outside-graphs`` compiles the fusepass variants with
``PassConfig(split_k_outside_cuda_graphs=True)``, the decode split-K that compiled code outside
CUDA graphs dropped in run 9. Run it as its own process against a default one: Dynamo may reuse
a compiled graph for a second model of the same class and backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fusepass  # noqa: E402
from fusepass.demo import models  # noqa: E402

# (quantization, quantizer, fused by fusepass) of each variant; None: the bf16 model.
VARIANTS = {
    "bf16": (None, None, False),
    "fp8-stock": ("fp8", "torchao", False),
    "fp8": ("fp8", "torchao", True),
    "int8": ("int8", "torchao", True),
    "int8-handwritten": ("int8", "handwritten", True),
}
# The same with fusepass's grouping of sibling matmuls off (PassConfig(group_max_m=0)): the
# A/B of run 12's one launch for q/k/v.
UNGROUPED = "-ungrouped"
VARIANTS.update({name + UNGROUPED: spec for name, spec in VARIANTS.items() if spec[2]})
CUDA_SIZES = models.Sizes(4, 4096, 14336, 32, 8, 32000)  # Llama-3-8B layers, the demo's CUDA default
CPU_SIZES = models.Sizes(1, 256, 512, 4, 2, 1024)  # a smoke run: CPU timings say nothing of a GPU's
MAX_LEN = 64


def kernel_family(name: str) -> str:
    """The family of a CUDA kernel, by its name. Inductor names a kernel after the graph
    nodes it computes, so split-K's counter fills, named after the rewritten quantization
    nodes, count as "amax/clamp" with the activations' quantization (run 8)."""
    if any(k in name for k in ("attention", "sdpa", "flash", "fmha")):
        return "attention"
    if any(k in name for k in ("scaled_mm_kernel", "scaled_mm_group_kernel", "scaled_gemv_kernel",
                                 "blockwise_mm_kernel", "nvjet", "gemm", "cutlass")):
        return "gemm"
    if "amax" in name or "clamp" in name:
        return "amax/clamp"
    if "zeros" in name or "fill" in name or "memset" in name.lower() or "vectorized_elementwise" in name:
        return "zeros/fill"
    return "other"


def compile_variant(model, fused: bool, split_outside_graphs: bool, grouped: bool = True):
    if not fused:
        return torch.compile(model, dynamic=False)
    config = fusepass.PassConfig(split_k_outside_cuda_graphs=split_outside_graphs,
                                 group_max_m=fusepass.PassConfig.group_max_m if grouped else 0)
    # (the backend keeps the PassConfig of its options)
    return torch.compile(model, backend="fusepass", dynamic=False, options=fusepass.inductor_options(config=config))


def step_ms(fn, inputs: dict, steps: int, device: torch.device) -> float:
    """Median wall ms of a decode step after 3 warm-up ones."""
    times = []
    for i in range(steps + 3):
        inputs["past_key_values"].reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(**inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile_step(fn, inputs: dict, cuda: bool, table: str | None = None, steps: int = 5) -> dict:
    """Over ``steps`` steps under ``torch.profiler`` (the cache reset once before them: its
    fills are no part of a step): the host's profiled ms per step, and on CUDA the kernels per
    step (by family) and their GPU ms per step. ``table``: write the profiler's tables there
    (by host time, and on CUDA by GPU time)."""
    from torch.profiler import ProfilerActivity, profile

    inputs["past_key_values"].reset()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):  # (steps < MAX_LEN: the cache does not fill up)
            fn(**inputs)
        sync()
    events = prof.key_averages()
    out = {"profiled_host_ms": round(sum(e.self_cpu_time_total for e in events) / steps / 1e3, 3)}
    if cuda:
        families, gpu_us = Counter(), 0.0
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                families[kernel_family(e.key)] += e.count / steps
                gpu_us += e.self_device_time_total / steps
        out.update(kernels=round(sum(families.values()), 1), gpu_ms=round(gpu_us / 1e3, 3),
                   families={k: round(v, 1) for k, v in sorted(families.items())})
    if table:
        with open(table, "w") as f:
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=40))
            if cuda:
                f.write(events.table(sort_by="self_device_time_total", row_limit=40))
    return out


def run(variants: list[str], sizes: models.Sizes, batch: int, rounds: int, steps: int, device: torch.device,
        split_outside_graphs: bool = False, profile_dir: str | None = None, log=print) -> dict:
    """Build, compile, time and profile ``variants``; returns the results (the JSON written).
    ``profile_dir``: the profiler's tables of each variant go there."""
    with models.quiet_imports(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = models.random_llama(sizes, MAX_LEN, device, 0)
        ids = models.prompt(base, batch, 1, 0)
        calls = {}
        for name in variants:
            quant, quantizer, fused = VARIANTS[name]
            model = base if quant is None else models.quantized_copy(base, quant, quantizer)
            inputs = models.decode_inputs(ids, models.static_cache(model, batch, MAX_LEN))
            fn = compile_variant(model, fused, split_outside_graphs, grouped=not name.endswith(UNGROUPED))
            t = time.perf_counter()
            with torch.no_grad():
                step_ms(fn, inputs, 1, device)  # compiles
            log(f"... {name}: compiled in {time.perf_counter() - t:.1f} s")
            calls[name] = (fn, inputs)
    rows = {name: {"step_ms": []} for name in variants}
    with torch.no_grad():
        for r in range(rounds):
            for name, (fn, inputs) in calls.items():
                rows[name]["step_ms"].append(round(step_ms(fn, inputs, steps, device), 3))
            log(f"... round {r + 1}/{rounds}: " + ", ".join(f"{n} {v['step_ms'][-1]:.2f} ms" for n, v in rows.items()))
        for name, (fn, inputs) in calls.items():
            path = os.path.join(profile_dir, f"profile-{name}.txt") if profile_dir else None
            rows[name].update(profile_step(fn, inputs, device.type == "cuda", path))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "batch": batch, "sizes": dataclasses.asdict(sizes),
            "split_outside_graphs": split_outside_graphs, "rows": rows}


def table(result: dict) -> str:
    """A markdown table of a result, each step also against bf16's in the same round."""
    rows, bf16 = result["rows"], result["rows"].get("bf16", {}).get("step_ms")
    lines = [f"{result['gpu']}, batch {result['batch']}, default torch.compile"
             + (", fusepass rows split K outside CUDA graphs" if result["split_outside_graphs"] else ""),
             "| variant | step ms (rounds) | / bf16's (rounds) | CUDA kernels per step | GPU ms per step "
             "| host ms per step, profiled |",
             "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        ratio = " / ".join(f"{s / b:.2f}" for s, b in zip(row["step_ms"], bf16)) if bf16 and name != "bf16" else ""
        lines.append(f"| {name} | {' / '.join(f'{s:.2f}' for s in row['step_ms'])} | {ratio} | "
                     f"{row.get('kernels', '')} | {row.get('gpu_ms', '')} | {row.get('profiled_host_ms', '')} |")
    if result["gpu"] == "CPU":
        lines.append("CPU timings: fusepass's CPU ops are its reference implementation; they say nothing of a GPU's.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="bf16,fp8-stock,fp8,int8-handwritten",
                    help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=17, help="timed steps per round (median)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--split-outside-graphs", action="store_true",
                    help="compile the fusepass variants with PassConfig(split_k_outside_cuda_graphs=True)")
    ap.add_argument("--out", default=None, help="the JSON (default: results/<gpu>-<date>-decode-step[-b<batch>].json)")
    ap.add_argument("--profile-dir", default=None, help="write each variant's profiler tables here")
    args = ap.parse_args(argv)
    if args.profile_dir and not os.path.isdir(args.profile_dir):
        ap.error(f"--profile-dir {args.profile_dir}: no such directory")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    if min(args.batch, args.rounds, args.steps) < 1:
        ap.error("--batch, --rounds and --steps must be >= 1")
    device = torch.device(args.device)
    if device.type == "cpu" and any(VARIANTS[v][0] == "fp8" for v in variants):
        ap.error("the fp8 variants need a CUDA GPU")
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    result = run(variants, sizes, args.batch, args.rounds, args.steps, device, args.split_outside_graphs,
                 args.profile_dir)
    print(table(result))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"{result['gpu'].replace(' ', '_')}-{result['date']}-decode-step"
                                   f"{'' if args.batch == 1 else f'-b{args.batch}'}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
