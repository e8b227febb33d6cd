"""The block-wise fp8 benchmark (issue 14): fusepass.scaled_mm_blockwise (which runs cuBLAS's
GEMM above ``CUBLAS_ABOVE_M`` rows on an sm90 GPU) and its Triton kernel alone at every M,
against cuBLAS's block-wise ``torch._scaled_mm`` (1x128 activation groups, 128x128 weight
blocks), the dequantize-then-bf16 path a user writes without either (eager, and under
torch.compile), the same path through the fusepass backend, and bf16 ``F.linear``.

    python benchmarks/bench_blockwise.py                          # Llama-3-8B and DeepSeek-V3 linears
    python benchmarks/bench_blockwise.py --shapes dsv3 --ms 1,16,4096 --no-compile
    python benchmarks/bench_blockwise.py --plot results/X.json      # redraw and summarize a result
    TRITON_INTERPRET=1 python benchmarks/bench_blockwise.py --smoke --out /tmp/b   # CPU: one tiny shape

Protocol (BENCHMARKS.md, with bench_linear.py's helpers): each implementation is captured in a
CUDA graph of R calls over R rotating copies of its inputs (together > 3x L2: cold weights);
a point's graphs are replayed in bench_linear's turns (5 rotating rounds of 5 replays, the
GPU idle after each turn as long as it ran), median per call; with its floor (bytes over the measured read bandwidth, or
2MNK over the measured fp8 peak). Before timing, every fp8 path's output is checked against an
fp32 dequantized reference (relative Frobenius error, in the JSON as ``rel_err``). Writes
``benchmarks/results/<gpu>-<date>-blockwise-<shapes>.json`` and .png, prints a table and the
M up to which the Triton kernel beats cuBLAS at every shape (what the op's cuBLAS rule rests
on; the pass fuses block-wise ``torch._scaled_mm`` on CUDA only up to ``PassConfig.fp8_max_m``).

``--smoke`` runs one tiny ragged shape with a wall-clock timer on whatever device there is
(on a CPU, the Triton kernel in Triton's interpreter) to check this script's code paths; it
writes JSON only with ``--out``.
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

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton sees the kernels
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_linear as bl  # noqa: E402  (puts the repo root on sys.path and imports fusepass)

import fusepass  # noqa: E402
from fusepass.kernels.blockwise_launch import CUBLAS_ABOVE_M, launch_scaled_mm_blockwise, select_config  # noqa: E402
from fusepass.passes import PassConfig  # noqa: E402

F = torch.nn.functional
BF16 = torch.bfloat16
BLOCK = 128
KERNEL = "fusepass blockwise, Triton kernel"
SHAPES = {
    "8b": bl.SHAPES["8b"],
    # DeepSeek-V3 (hidden 7168): q_a, kv_a (N = 576: a ragged last block), q_b, o_proj, dense MLP gate_up, down.
    "dsv3": [(1536, 7168), (576, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432)],
}
SMOKE_SHAPE, SMOKE_MS = (200, 300), [4]  # ragged K (3 groups) and N (2 blocks)
TOL = 2e-2  # relative Frobenius error of a bf16 result (the dequant path rounds its operands to bf16 too)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def dequant_linear(a, sa, w, sw):
    """What a user writes without a block-wise GEMM: dequantize both operands to bf16, F.linear."""
    K, N = a.shape[1], w.shape[0]
    x = (a.to(BF16) * sa.repeat_interleave(BLOCK, 1)[:, :K]).to(BF16)
    wd = (w.to(BF16) * sw.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]).to(BF16)
    return F.linear(x, wd)


def make_inputs(kind: str, M: int, N: int, K: int, device, g: torch.Generator) -> dict:
    if kind == "bf16":
        return {"x": torch.randn(M, K, device=device, generator=g).to(BF16),
                "w": torch.randn(N, K, device=device, generator=g).to(BF16)}
    a = torch.randn(M, K, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(N, K, device=device, generator=g).to(torch.float8_e4m3fn)
    sa = (torch.rand(blocks(K), M, device=device, generator=g) / 100 + 1e-3).t()  # M-major, as cuBLAS takes it
    sw = torch.rand(blocks(N), blocks(K), device=device, generator=g) / 100 + 1e-3  # the weight's [N/128, K/128]
    return {"a": a, "b": w.t(), "sa": sa, "sb": sw.t(), "w": w, "sw": sw}


def implementations(compile_: bool, device: str) -> dict:
    """name -> (input kind, fn(inputs) -> output) for one (N, K): compiled paths are fresh per
    shape (one static compile, then one with a dynamic M)."""
    impls = {
        "bf16 F.linear": ("bf16", lambda t: F.linear(t["x"], t["w"])),
        "fp8 torch._scaled_mm block-wise": ("fp8", lambda t: torch._scaled_mm(t["a"], t["b"], t["sa"], t["sb"], out_dtype=BF16)),
        "fp8 dequant + bf16 eager": ("fp8", lambda t: dequant_linear(t["a"], t["sa"], t["w"], t["sw"])),
        "fusepass blockwise": ("fp8", lambda t: fusepass.scaled_mm_blockwise(t["a"], t["b"], t["sa"], t["sb"], BF16)),
        # The Triton kernel at every M: the op runs cuBLAS's GEMM above CUBLAS_ABOVE_M on an
        # sm90 GPU, and on a CPU the reference (the kernel runs in Triton's interpreter here).
        KERNEL: ("fp8", lambda t: launch_scaled_mm_blockwise(t["a"], t["b"], t["sa"], t["sb"], BF16,
                                                             config=kernel_config(t["a"], t["b"]))),
    }
    if compile_:
        # Dynamo caches per code object, 8 entries at most: a fresh cache per shape keeps its
        # 4 (2 backends x static, then dynamic M) from falling back to eager.
        torch._dynamo.reset()
        stock, ours = torch.compile(dequant_linear), torch.compile(dequant_linear, backend="fusepass")
        impls["fp8 dequant + bf16 torch.compile"] = ("fp8", lambda t: stock(t["a"], t["sa"], t["w"], t["sw"]))
        impls["fusepass backend, dequant form"] = ("fp8", lambda t: ours(t["a"], t["sa"], t["w"], t["sw"]))
    return impls


def kernel_config(a: torch.Tensor, b: torch.Tensor):
    """The table's config for this problem: passing it forces the Triton kernel."""
    return select_config(a.shape[0], b.shape[1], a.shape[1], a.device)


def reference(t: dict) -> torch.Tensor:
    """fp32 dequantized matmul of one fp8 input set (PyTorch's default: no TF32)."""
    K, N = t["a"].shape[1], t["w"].shape[0]
    sa = t["sa"].float().repeat_interleave(BLOCK, 1)[:, :K]
    sw = t["sw"].float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (t["a"].float() * sa) @ (t["w"].float() * sw).t()


def wall_time_us(fn, t: dict, reps: int = 3) -> float:
    """--smoke: median wall-clock time of ``reps`` calls after one warm-up (no CUDA graphs)."""
    fn(t)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(t)
        if t["a" if "a" in t else "x"].is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def floor_us(M: int, N: int, K: int, ceil: dict) -> dict:
    """Per input kind: bytes that must move over the read bandwidth, or 2MNK over the dense peak."""
    nbytes = M * K + N * K + 4 * (M * blocks(K) + blocks(K) * blocks(N)) + 2 * M * N
    fp8 = max(nbytes / (bl.memory_tbps(ceil)[0] * 1e6), 2 * M * N * K / (ceil["fp8_TFLOPS"] * 1e6))
    return {"fp8": fp8, "bf16": bl.floor_us("bf16", M, N, K, ceil)}


def bench_point(M, N, K, impls, device, ceil, l2_bytes, log) -> dict:
    g = torch.Generator(device=device).manual_seed(M * 7 + N + K)
    row = {"M": M, "N": N, "K": K, "us": {}, "rel_err": {}, "floor_us": floor_us(M, N, K, ceil) if ceil else None}
    sets, ref, graphs = {}, None, {}
    for name, (kind, fn) in impls.items():
        if kind not in sets:  # one set of rotating copies per input kind, shared by its paths
            per_call = (2 if kind == "bf16" else 1) * (M + N) * K  # bytes of a and w
            copies = 1 if ceil is None else max(1, min(64, math.ceil(3 * l2_bytes / per_call)))
            sets[kind] = [make_inputs(kind, M, N, K, device, g) for _ in range(copies)]
            if kind == "fp8":
                ref = reference(sets[kind][0])
        inputs = sets[kind]
        try:
            if kind == "fp8":  # never time a wrong answer
                err = ((fn(inputs[0]).float() - ref).norm() / ref.norm()).item()
                row["rel_err"][name] = err
                if not err <= TOL:
                    raise AssertionError(f"relative error {err:.3g} > {TOL}")
            if ceil is None:
                row["us"][name] = wall_time_us(fn, inputs[0])
            else:
                graphs[name] = bl.Graph(lambda i, inputs=inputs, fn=fn: (lambda t=inputs[i]: fn(t)), len(inputs))
        except Exception as e:  # reported, not fatal: the table says which path failed
            row["us"][name] = None
            log(f"  {name} at M={M} N={N} K={K} failed: {str(e).splitlines()[0][:120]}")
    if graphs:  # timed in turns, as bench_linear's points are (bench_linear.interleaved_us)
        timed = bl.interleaved_us(graphs, log)
        row["us"] = {name: timed[name] if name in timed else row["us"].get(name) for name in impls}
    del sets, ref, graphs
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def summarize(result: dict) -> list[str]:
    """Ratios > 1: fusepass faster. The crossover is the Triton kernel's (the op's where a
    result has no kernel row): where it beats cuBLAS is what the op's cuBLAS rule rests on."""
    rows, out = result["rows"], []
    ours, cublas, dq = "fusepass blockwise", "fp8 torch._scaled_mm block-wise", "fp8 dequant + bf16 eager"
    ms = sorted({r["M"] for r in rows})

    def ratios(base, m, of=ours):
        return [r["us"][base] / r["us"][of] for r in rows if r["M"] == m and r["us"].get(base) and r["us"].get(of)]

    # The crossover: the largest M up to which we are faster at every shape, over the Ms
    # from the first one cuBLAS runs (it refuses M = 1 on torch 2.11); an M it skips after
    # that ends the run, as one where it is faster does.
    faster_up_to, first, ended = None, None, False
    for m in ms:
        x = ratios(cublas, m)
        floors = [r["floor_us"]["fp8"] / r["us"][ours] for r in rows if r["M"] == m and r.get("floor_us") and r["us"].get(ours)]
        if floors:
            out.append(f"M={m}: fusepass at {min(floors):.0%}-{max(floors):.0%} of its floor")
        if x:
            out.append(f"M={m}: {bl._geomean(x):.2f}x cuBLAS block-wise (min {min(x):.2f}x, max {max(x):.2f}x); "
                       f"{bl._geomean(ratios(dq, m)):.2f}x the dequantize + bf16 path")
            first = m if first is None else first
            k = ratios(cublas, m, of=KERNEL)
            if k:
                out.append(f"M={m}: the Triton kernel alone {bl._geomean(k):.2f}x cuBLAS block-wise "
                           f"(min {min(k):.2f}x, max {max(k):.2f}x)")
                x = k
        elif ratios(dq, m):
            out.append(f"M={m}: cuBLAS block-wise did not run; {bl._geomean(ratios(dq, m)):.2f}x the dequantize + bf16 path")
        if first is not None and not ended:
            ended = not x or min(x) <= 1
            faster_up_to = faster_up_to if ended else m
    if first is not None:
        where = (f"for every M up to {faster_up_to}" if faster_up_to is not None
                 else f"at no M: cuBLAS is faster at some shape at M = {first}")
        out.append(f"fused faster than cuBLAS at every shape {where} (on an sm90 GPU the op runs cuBLAS's "
                   f"block-wise GEMM above M = {CUBLAS_ABOVE_M}; the pass fuses block-wise torch._scaled_mm on "
                   f"CUDA up to PassConfig.fp8_max_m = {PassConfig().fp8_max_m})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8b,dsv3", help="comma list of 8b / dsv3")
    p.add_argument("--ms", default=",".join(map(str, bl.MS)), help="comma list of M")
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results; --smoke: none)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile paths")
    p.add_argument("--smoke", action="store_true", help="one tiny shape, wall-clock timing, any device")
    p.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier result and summarize it")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        bl.plot(result, args.plot.replace(".json", ".png"))
        log("\n".join(summarize(result)))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        p.error("needs a CUDA GPU (or --smoke)")
    try:
        shapes = [SMOKE_SHAPE] if args.smoke else [s for name in args.shapes.split(",") for s in SHAPES[name]]
        ms = SMOKE_MS if args.smoke else [int(m) for m in args.ms.split(",")]
    except (KeyError, ValueError) as e:
        p.error(f"bad --shapes/--ms: {e}")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    log(f"{gpu}, torch {torch.__version__}" + (", smoke run" if args.smoke else "; measuring ceilings ..."))
    ceil = None if args.smoke else bl.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    rows = []
    for N, K in shapes:
        impls = implementations(not (args.no_compile or args.smoke), device)
        for M in ms:
            t0 = time.perf_counter()
            rows.append(bench_point(M, N, K, impls, device, ceil, l2, log))
            log(f"[{len(rows)}/{len(shapes) * len(ms)}] M={M} N={N} K={K} ({time.perf_counter() - t0:.1f} s)")
    import triton

    result = {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": triton.__version__, "smoke": args.smoke, "ceilings": ceil, "rows": rows}
    bl.print_table(rows, log)
    log("\n".join(summarize(result)))
    out = args.out or (None if args.smoke else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    if out:
        os.makedirs(out, exist_ok=True)
        stem = os.path.join(out, f"{gpu.replace(' ', '_')}-{result['date']}-blockwise-"
                                 f"{'smoke' if args.smoke else args.shapes.replace(',', '_')}")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        if not args.smoke:
            bl.plot(result, stem + ".png")
        log(f"wrote {stem}.json" + ("" if args.smoke else " and .png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
