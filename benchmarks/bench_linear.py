"""The kernel benchmark of BENCHMARKS.md: fusepass vs every PyTorch path, on one GPU.

    python benchmarks/bench_linear.py                      # all 8 shapes, all M
    python benchmarks/bench_linear.py --shapes 8b --ms 1,16,4096
    python benchmarks/bench_linear.py --plot results/X.json   # redraw a plot only

Protocol: each implementation is captured in a CUDA graph of R calls over R rotating
copies of its inputs (together > 3x L2, so every call reads cold weights). A point's graphs
are replayed in turns (5 rounds of 5 replays each, the order rotating each round, the GPU
idle after each turn as long as the turn ran, so that no turn inherits the clocks its
predecessor's power draw left) and the median per call of the 25 is reported, with its
ratio to the floor (bytes over the measured read bandwidth, or 2MNK over the measured
dense peak).
Writes benchmarks/results/<gpu>-<date>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fusepass  # noqa: E402
from fusepass.kernels.configs import select_config  # noqa: E402
from fusepass.kernels.launch import cublas_device, launch_scaled_mm  # noqa: E402
from fusepass.kernels.policy import FP8_CUBLAS_ABOVE_M  # noqa: E402

SHAPES = {
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
    # Hugging Face LlamaForCausalLM keeps q/k/v and gate/up apart (torchao quantizes each):
    # k_proj / v_proj, gate_proj / up_proj, and lm_head at Llama-3's vocabulary.
    "8b-hf": [(1024, 4096), (14336, 4096), (128256, 4096)],
    # Qwen3-30B-A3B's dense linears (its experts are bench_grouped.py's): q/k/v joined, o_proj.
    "qwen3-30b-a3b": [(5120, 2048), (2048, 4096)],
}
MS = [1, 16, 64, 256, 1024, 4096, 16384]
REPLAYS = 25
ROUNDS = 5  # bench_point's implementations take turns of ceil(REPLAYS / ROUNDS) replays
# After each turn the GPU idles this many times the turn's length. Without it a turn ran at
# the clocks its predecessor's power draw left: per-token azp 1.06-1.22x symmetric's time at 5
# large-M points, 0.995-1.016x with REST = 1 and 0.991-1.017x with 3 (run 19, call 4).
REST = 1.0


class Graph:
    """``n_copies`` calls captured in one CUDA graph (call i uses copy i), ready to replay."""

    def __init__(self, make_call, n_copies: int):
        self.calls, self.n_copies = [make_call(i) for i in range(n_copies)], n_copies  # kept: the graph reads their inputs
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in self.calls:  # warm-up: compile, autotune, allocate
                c()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for c in self.calls:
                c()
        self.graph.replay()
        torch.cuda.synchronize()

    def times_us(self, replays: int) -> list[float]:
        """us per call of each of ``replays`` replays."""
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / self.n_copies)
        return times


def graph_time_us(make_call, n_copies: int) -> float:
    """Median us per call of a CUDA graph of ``n_copies`` calls (call i uses copy i), REPLAYS
    replays; then the GPU idles REST times as long, so the next timing starts from rest."""
    times = Graph(make_call, n_copies).times_us(REPLAYS)
    _rest(times, n_copies)
    return statistics.median(times)


def _rest(times: list[float], n_copies: int) -> None:
    """Idle the GPU REST times as long as replays of ``n_copies`` calls taking ``times`` us a call ran."""
    time.sleep(REST * sum(times) * n_copies / 1e6)


def interleaved_us(graphs: dict, log=print) -> dict:
    """Median us per call of each of ``graphs`` (name -> Graph), about REPLAYS replays each,
    taken in ROUNDS turns whose order rotates, the GPU idle for REST times a turn's length
    after each. Clocks drift within a point: timed one after the other, an implementation took
    that drift as its own (run 18: per-token azp at 1.17x symmetric's time at M = 4096,
    N = 8192, K = 28672; 0.99x in a probe that alternated them, run 19). A graph whose replay
    fails gets None and leaves the rotation."""
    names, times = list(graphs), {name: [] for name in graphs}
    per_turn = max(1, math.ceil(REPLAYS / ROUNDS))
    for r in range(ROUNDS):
        live = [name for name in names if times[name] is not None]
        if not live:
            break
        k = r % len(live)
        for name in live[k:] + live[:k]:
            try:
                turn = graphs[name].times_us(per_turn)
            except Exception as e:  # reported, not fatal, as a failed capture is
                log(f"  {name}: replay failed: {str(e).splitlines()[0][:100]}")
                times[name] = None
                continue
            times[name] += turn
            _rest(turn, graphs[name].n_copies)
    return {name: None if t is None else statistics.median(t) for name, t in times.items()}


def ceilings() -> dict:
    """Measured copy bandwidth (read + write bytes), read bandwidth, and dense peaks (8192^3)."""
    # The best of a few copies (read + write bytes): a 1 GiB uint8 copy_ alone measured
    # 2.7 TB/s on an H200 where larger float copies reach more.
    copy_tbps = 0.0
    for dtype, n in ((torch.uint8, 2**30), (torch.float32, 2**29), (torch.float32, 2**30)):
        x = torch.randn(n, device="cuda").to(dtype)
        y = torch.empty_like(x)
        copy_tbps = max(copy_tbps, 2 * x.nbytes / graph_time_us(lambda i, x=x, y=y: (lambda: y.copy_(x)), 1) / 1e6)
        del x, y
    # Decode reads its weight and writes almost nothing, so its ceiling is read bandwidth: the
    # best of full reductions over 1-4 GiB (a copy's write half runs slower than reads do: the
    # H200's 1 GiB copy measured 2.7 TB/s of traffic while our kernels read 4.1 TB/s).
    read_tbps = 0.0
    for dtype, n in ((torch.float32, 2**28), (torch.float32, 2**30), (torch.bfloat16, 2**31)):
        x = torch.ones(n, device="cuda", dtype=dtype)
        read_tbps = max(read_tbps, x.nbytes / graph_time_us(lambda i, x=x: (lambda: x.sum(dtype=torch.float32)), 1) / 1e6)
        del x
    n = 8192
    a8 = torch.randint(-128, 127, (n, n), dtype=torch.int8, device="cuda")
    b8 = torch.randint(-128, 127, (n, n), dtype=torch.int8, device="cuda").t()
    f8a, f8b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn), torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    bfa, bfb = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3
    return {
        "copy_TBps": copy_tbps,
        "read_TBps": read_tbps,
        "int8_TOPS": flops / graph_time_us(lambda i: (lambda: torch._int_mm(a8, b8)), 1) / 1e6,
        "fp8_TFLOPS": flops / graph_time_us(lambda i: (lambda: torch._scaled_mm(f8a, f8b, one, one, out_dtype=torch.bfloat16)), 1) / 1e6,
        "bf16_TFLOPS": flops / graph_time_us(lambda i: (lambda: bfa @ bfb), 1) / 1e6,
    }


def _epilogue(a, b, sa, sb, bias):
    return (torch._int_mm(a, b).float() * sa * sb + bias).to(torch.bfloat16)


def _azp_epilogue(a, b, sa, sb, azp, adj, bias):
    return ((torch._int_mm(a, b) - azp * adj).float() * sa * sb + bias).to(torch.bfloat16)


_compiled = {}
KERNEL_FP8 = "fusepass fp8, Triton kernel"


def _fp8_on_cublas() -> bool:
    """Whether the fp8 op runs cuBLAS above FP8_CUBLAS_ABOVE_M on this machine (launch.cublas_layout)."""
    return torch.cuda.is_available() and cublas_device(torch.device("cuda"))


def _fp8_kernel(t):
    M, K = t["a"].shape
    cfg = select_config(M, t["b"].shape[1], K, t["a"].dtype, t["a"].device)
    return launch_scaled_mm(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["bias"], config=cfg)


def implementations(M: int):
    """name -> (input kind, fn(inputs) -> output); None where PyTorch has no path."""
    big_m = M > 16  # torch._int_mm needs M > 16 on CUDA
    if "int8_compile" not in _compiled:
        _compiled["int8_compile"] = torch.compile(_epilogue, dynamic=True)
    impls = {
        "bf16 F.linear": ("bf16", lambda t: torch.nn.functional.linear(t["x"], t["w"], t["bias"])),
        "fp8 torch._scaled_mm": ("fp8", lambda t: torch._scaled_mm(t["a"], t["b"], t["sa"], t["sb"], bias=t["bias"], out_dtype=torch.bfloat16)),
        "int8 torch._int_mm alone": ("int8", lambda t: torch._int_mm(t["a"], t["b"])) if big_m else None,
        "int8 torch.compile": ("int8", lambda t: _compiled["int8_compile"](t["a"], t["b"], t["sa"], t["sb"], t["bias"])) if big_m else None,
        "int8 eager": ("int8", lambda t: _epilogue(t["a"], t["b"], t["sa"], t["sb"], t["bias"])) if big_m else None,
        "int8 azp per-token eager": ("int8", lambda t: _azp_epilogue(t["a"], t["b"], t["sa"], t["sb"], t["azp2"], t["adj2"], t["bias"])) if big_m else None,
        "fusepass int8": ("int8", lambda t: fusepass.scaled_mm(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["bias"])),
        "fusepass fp8": ("fp8", lambda t: fusepass.scaled_mm(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["bias"])),
        # where the op runs cuBLAS instead (an sm90 GPU), its Triton kernel alone, for comparison
        KERNEL_FP8: ("fp8", lambda t: _fp8_kernel(t)) if M > FP8_CUBLAS_ABOVE_M and _fp8_on_cublas() else None,
        "fusepass int8 azp per-token": ("int8", lambda t: fusepass.scaled_mm_azp(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["adj"], t["azp"], t["bias"])),
        "fusepass int8 azp per-tensor": ("int8", lambda t: fusepass.scaled_mm_azp(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["adj_t"], None, t["bias"])),
    }
    return {k: v for k, v in impls.items() if v is not None}


def make_inputs(kind: str, M: int, N: int, K: int, g: torch.Generator) -> dict:
    dev = "cuda"
    bias = torch.randn(N, device=dev, generator=g).to(torch.bfloat16)
    if kind == "bf16":
        return {"x": torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16),
                "w": torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16), "bias": bias}
    if kind == "fp8":
        a = torch.randn(M, K, device=dev, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(N, K, device=dev, generator=g).to(torch.float8_e4m3fn)
    else:
        a = torch.randint(-128, 127, (M, K), device=dev, generator=g, dtype=torch.int8)
        w = torch.randint(-128, 127, (N, K), device=dev, generator=g, dtype=torch.int8)
    t = {"a": a, "b": w.t(), "sa": torch.rand(M, 1, device=dev, generator=g) / 100,
         "sb": torch.rand(1, N, device=dev, generator=g) / 100, "bias": bias}
    if kind == "int8":
        colsum = w.sum(1, dtype=torch.int32)
        t["azp"] = torch.randint(-8, 8, (M,), device=dev, generator=g, dtype=torch.int32)
        t.update(adj=colsum, adj_t=3 * colsum, azp2=t["azp"][:, None], adj2=colsum[None, :])
    return t


def memory_tbps(ceil: dict) -> tuple[float, str, float]:
    """The bandwidth a kernel's bytes are held to, its name, and decode's target fraction of it:
    85% of the measured read bandwidth (issue 13), or for results before 2026-11-23, which have
    only the copy's, issue 5's 75% of that."""
    if ceil.get("read_TBps"):
        return ceil["read_TBps"], "read bandwidth", 0.85
    return ceil["copy_TBps"], "copy bandwidth", 0.75


def floor_us(kind: str, M: int, N: int, K: int, ceil: dict) -> float:
    elt = 2 if kind == "bf16" else 1
    nbytes = elt * (M * K + K * N) + 4 * (M + N) + 2 * N + 2 * M * N
    mem = nbytes / (memory_tbps(ceil)[0] * 1e6)
    # int8 and fp8 share one tensor-core rate on Hopper; _int_mm's measured peak (952 TOPS on
    # the H200) is below what our int8 kernel reaches (1415 TOPS, run 19), so the faster holds both.
    fast = max(ceil["fp8_TFLOPS"], ceil["int8_TOPS"])
    peak = {"bf16": ceil["bf16_TFLOPS"], "fp8": fast, "int8": fast}[kind]
    return max(mem, 2 * M * N * K / (peak * 1e6))


def bench_point(M, N, K, ceil, l2_bytes, log):
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    row = {"M": M, "N": N, "K": K, "us": {}, "floor_us": {}}
    impls, graphs = implementations(M), {}
    for name, (kind, fn) in impls.items():
        per_call = (2 if kind == "bf16" else 1) * (M * K + N * K)
        copies = max(1, min(64, math.ceil(3 * l2_bytes / per_call)))
        sets = [make_inputs(kind, M, N, K, g) for _ in range(copies)]
        try:
            graphs[name] = Graph(lambda i, sets=sets, fn=fn: (lambda t=sets[i]: fn(t)), copies)
        except Exception as e:  # reported, not fatal: the table says which path failed
            log(f"  {name} at M={M} N={N} K={K} failed: {str(e).splitlines()[0][:100]}")
        row["floor_us"][kind] = floor_us(kind, M, N, K, ceil)
    us = interleaved_us(graphs, log)
    row["us"] = {name: us.get(name) for name in impls}
    del graphs
    torch.cuda.empty_cache()
    return row


def host_overhead_us(n=2000) -> float:
    """Host time of one fusepass.scaled_mm call (checks + dispatch + launch), small shape."""
    t = make_inputs("int8", 16, 256, 256, torch.Generator(device="cuda").manual_seed(0))
    call = lambda: fusepass.scaled_mm(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["bias"])  # noqa: E731
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    dt = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return dt * 1e6


def max_autotune_points(points, log):
    """Inductor max-autotune for _int_mm + epilogue at two shapes, with its compile time."""
    out = []
    for M, N, K in points:
        torch._dynamo.reset()
        t = make_inputs("int8", M, N, K, torch.Generator(device="cuda").manual_seed(1))
        fn = torch.compile(_epilogue, mode="max-autotune-no-cudagraphs")
        t0 = time.perf_counter()
        fn(t["a"], t["b"], t["sa"], t["sb"], t["bias"])
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        us = graph_time_us(lambda i: (lambda: fn(t["a"], t["b"], t["sa"], t["sb"], t["bias"])), 1)
        log(f"  max-autotune M={M} N={N} K={K}: {us:.1f} us, compile {compile_s:.0f} s")
        out.append({"M": M, "N": N, "K": K, "us": us, "compile_s": compile_s})
    return out


def print_table(rows, log):
    names = list(dict.fromkeys(n for r in rows for n in r["us"]))
    log("| M | N | K | " + " | ".join(names) + " |")
    log("|---" * (3 + len(names)) + "|")
    for r in rows:
        cells = ["-" if r["us"].get(n) is None else f"{r['us'][n]:.1f}" for n in names]
        log(f"| {r['M']} | {r['N']} | {r['K']} | " + " | ".join(cells) + " |")


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarize(result: dict) -> list[str]:
    """Issue 13's targets (and issue 5's before them), read off a result (ratios > 1: fusepass faster)."""
    rows = result["rows"]
    bw, bw_name, target = memory_tbps(result["ceilings"])
    out = []

    def ratios(mine, base, ms):
        return [r["us"][base] / r["us"][mine] for r in rows if r["M"] in ms and r["us"].get(mine) and r["us"].get(base)]

    def weight_tbps(name, ms):  # weight bytes over time: decode is bound by reading the weight
        return [r["N"] * r["K"] / r["us"][name] / 1e6 for r in rows if r["M"] in ms and r["us"].get(name)]

    big = (64, 256, 1024, 4096, 16384)
    x = ratios("fusepass int8", "int8 torch.compile", big)
    if x:
        tops = [2 * r["M"] * r["N"] * r["K"] / r["us"]["fusepass int8"] / 1e6 for r in rows if r["M"] >= 4096]
        out.append(f"int8, M>=64: geomean {_geomean(x):.2f}x torch.compile (target 1.35x), min {min(x):.2f}x (target 1.0x); "
                   f"M>=4096: {min(tops):.0f}-{max(tops):.0f} TOPS (target 1400)")
    x = ratios("fusepass int8", "fp8 torch._scaled_mm", (1024, 4096, 16384))
    if x:
        out.append(f"int8, M>=1024: {min(x):.2f}-{max(x):.2f}x fp8 torch._scaled_mm, the same tensor-core peak "
                   f"(target >= 1.0x at every point: {sum(v >= 1.0 for v in x)} of {len(x)})")
    for ms in ((1,), (16,)):
        bf16 = [2 * t for t in weight_tbps("bf16 F.linear", ms)]  # 2 bytes a weight
        bf16_line = f"; bf16 F.linear reads {min(bf16):.2f}-{max(bf16):.2f} TB/s" if bf16 else ""
        w = weight_tbps("fusepass int8", ms)
        x = ratios("fusepass int8", "bf16 F.linear", ms)
        if w:
            out.append(f"int8, M={ms[0]}: weight read {min(w):.2f}-{max(w):.2f} TB/s = {min(w) / bw:.0%}-{max(w) / bw:.0%} "
                       f"of {bw_name} {bw:.2f} (target {target:.0%}){bf16_line}; {min(x):.2f}-{max(x):.2f}x bf16 F.linear "
                       "(target 1.8x)")
        w = weight_tbps("fusepass fp8", ms)
        x = ratios("fusepass fp8", "fp8 torch._scaled_mm", ms)
        if w:
            out.append(f"fp8, M={ms[0]}: {min(x):.2f}-{max(x):.2f}x torch._scaled_mm (target 1.5x); weight read "
                       f"{min(w) / bw:.0%}-{max(w) / bw:.0%} of {bw_name} (target {target:.0%})")
    x = ratios("fusepass fp8", "fp8 torch._scaled_mm", big)
    if x:
        out.append(f"fp8, M>=64: geomean {_geomean(x):.2f}x torch._scaled_mm (target 1.05x), min {min(x):.2f}x (target 0.95x)")
    x = ratios(KERNEL_FP8, "fp8 torch._scaled_mm", big)
    if x:
        out.append(f"fp8 Triton kernel alone (the op runs cuBLAS above M = {FP8_CUBLAS_ABOVE_M}), M>=64: geomean "
                   f"{_geomean(x):.2f}x torch._scaled_mm, min {min(x):.2f}x")
    for azp in ("per-token", "per-tensor"):
        x = [r["us"][f"fusepass int8 azp {azp}"] / r["us"]["fusepass int8"] for r in rows
             if r["us"].get(f"fusepass int8 azp {azp}") and r["us"].get("fusepass int8")]
        if x:
            out.append(f"int8 azp {azp}: {_geomean(x):.3f}x (max {max(x):.3f}x) the time of symmetric (target <= 1.05x)")
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in result["rows"]))
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(shapes) / cols), cols, figsize=(5 * cols, 4 * math.ceil(len(shapes) / cols)), squeeze=False)
    for ax, (N, K) in zip(axes.flat, shapes):
        rows = [r for r in result["rows"] if (r["N"], r["K"]) == (N, K)]
        names = list(dict.fromkeys(n for r in rows for n in r["us"]))
        for name in names:
            pts = [(r["M"], 2 * r["M"] * N * K / r["us"][name] / 1e6) for r in rows if r["us"].get(name)]
            if pts:
                style = "-o" if name.startswith("fusepass") else "--."
                ax.plot(*zip(*pts), style, label=name, linewidth=2 if name.startswith("fusepass") else 1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"N={N}, K={K}")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("TFLOPS (TOPS for int8)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{result['gpu']}, {result['date']}: CUDA graphs, cold L2, median of {REPLAYS} replays")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8b,70b", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)), help="comma list of M")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--max-autotune", action="store_true", help="also time Inductor max-autotune at two shapes")
    p.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier result and summarize it")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        plot(result, args.plot.replace(".json", ".png"))
        print("\n".join(summarize(result)))
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    try:
        shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
        ms = [int(m) for m in args.ms.split(",")]
    except (KeyError, ValueError) as e:
        p.error(f"bad --shapes/--ms: {e}")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    gpu = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    log(f"{gpu}, torch {torch.__version__}; measuring ceilings ...")
    ceil = ceilings()
    log("  " + ", ".join(f"{k} {v:.0f}" if v > 10 else f"{k} {v:.2f}" for k, v in ceil.items()))
    rows = []
    for N, K in shapes:
        for M in ms:
            t0 = time.perf_counter()
            rows.append(bench_point(M, N, K, ceil, l2, log))
            log(f"[{len(rows)}/{len(shapes) * len(ms)}] M={M} N={N} K={K} ({time.perf_counter() - t0:.1f} s)")
    result = {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "ceilings": ceil, "host_us_per_call": host_overhead_us(), "rows": rows}
    if args.max_autotune:
        result["max_autotune"] = max_autotune_points([(4096, 4096, 4096), (64, 28672, 4096)], log)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{gpu.replace(' ', '_')}-{result['date']}-{args.shapes.replace(',', '_')}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    log(f"host overhead of one fusepass.scaled_mm call: {result['host_us_per_call']:.1f} us")
    print_table(rows, log)
    log("\n".join(summarize(result)))
    log(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
