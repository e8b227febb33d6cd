"""The mixture-of-experts GEMM benchmark: ``fusepass.scaled_grouped_mm`` (int8 and fp8, per-row
and per-channel scales, bf16 out) at a MoE model's experts, against bf16 ``torch._grouped_mm``
(the GEMM of transformers' ``grouped_mm`` experts), at decode (8 rows: batch 1, top-8), batch
16 and prefill row counts; at the row kernel's row counts also down as ``W8A8Experts`` runs it
there (``fusepass int8 gated``: bf16 gate and up rows, their SiLU-mul quantized in the launch,
``scaled_grouped_mm_dynamic``'s); with ``--sweep``, the op's launch at each of a list of tiles;
with ``--quantize``, ``quantize_rows_kernel`` alone on down's gated rows (``quantized_rows``:
the SiLU-mul of a [M, 2I] output's halves quantized per row to int8; TB/s of the bytes it moves),
with ``--sweep`` at each of QUANTIZE_SWEEP's (piece, slots, warps) too.

    python benchmarks/bench_grouped.py                                   # both shapes, every M
    python benchmarks/bench_grouped.py --shapes qwen3-30b-a3b --ms 8 --sweep
    python benchmarks/bench_grouped.py --shapes qwen3-30b-a3b --ms 16384 --quantize --sweep
    TRITON_INTERPRET=1 python benchmarks/bench_grouped.py --smoke         # CPU: one tiny shape

Protocol (BENCHMARKS.md, with bench_linear.py's helpers): each implementation is captured in a
CUDA graph of R calls, call i with its own routing and rows (each token's top-k distinct
experts drawn at random), R such that the routed experts' weights of all calls together pass
3x L2: a decode call reads its experts from memory, as a model's step does (the same routing
replayed would read them from L2). The graphs are replayed in bench_linear's rotating turns,
median per call. The fusepass op sorts the rows inside its launch where it does
(``grouped_launch.route``); ``torch._grouped_mm`` is timed on rows already sorted by expert,
its offsets given (transformers sorts them in other kernels before it). ``TB/s``: the routed
experts' weight bytes (each hit expert's [K, N] once) over the time. Before timing, each
fusepass output is checked against its dequantized float reference.

``--smoke`` runs one tiny shape with a wall-clock timer on whatever device there is (on a CPU,
the kernels in Triton's interpreter) to check this script's code paths.
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

from fusepass.integrations.linear import SCALE_EPS  # noqa: E402
from fusepass.kernels.grouped_launch import (  # noqa: E402
    Recipe, fitted_stages, launch_scaled_grouped_mm, quantized_rows)
from fusepass.kernels.policy import GROUPED_ROWS_MAX_M, GroupedTiles, grouped_tiles  # noqa: E402
from fusepass.ops.dynamic import quantize_rows  # noqa: E402

BF16 = torch.bfloat16
# (experts, hidden, expert width, top-k)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "olmoe-1b-7b": (64, 2048, 1024, 8)}
SMOKE_SHAPE, SMOKE_MS = (8, 96, 40, 2), [2, 40]  # the row kernel's M and the blocks'
MS = [8, 128, 1024, 16384]
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SWEPT = "int8 at "  # the name of a swept tile's row: SWEPT + its tiles
GATED = "fusepass int8 gated"  # down's rows as bf16 gate and up, SiLU-mul and quantization in the launch
SWEPT_GATED = "int8 gated at "
TOL = 2e-2  # relative Frobenius error of a bf16 result against the float reference
# --sweep: (rows kernel?, block_m, block_n, block_k, warps, stages)
SWEEP = [GroupedTiles(True, 1, n, k, w, 3) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (2, 4)] + [
    GroupedTiles(False, *t) for t in ((16, 64, 256, 4, 3), (16, 128, 128, 4, 4), (16, 128, 256, 8, 3),
                                      (32, 128, 128, 4, 4), (64, 128, 128, 4, 4), (64, 256, 128, 8, 3),
                                      (64, 256, 128, 8, 4), (128, 128, 128, 8, 3), (128, 128, 256, 8, 3),
                                      (128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 3))]

QUANTIZED = "quantize_rows"  # --quantize: quantize_rows_kernel alone, at the launch's defaults
# --quantize --sweep: (piece, slots, warps) of quantized_rows
QUANTIZE_SWEEP = [(p, s, w) for p in (256, 128, 64) for s in (4, 8, 16, 32) for w in (2, 4, 8)]


def projections(shape: str) -> dict:
    """name -> (E, K, N, top_k) of a shape's two expert GEMMs."""
    E, H, I, k = SMOKE_SHAPE if shape == "smoke" else SHAPES[shape]
    return {"gate_up": (E, H, 2 * I, k), "down": (E, I, H, k)}


def routing(M: int, E: int, k: int, device, g) -> torch.Tensor:
    """[M] expert ids: M // k tokens' k distinct experts each (a router's top-k)."""
    tokens = max(1, M // k)
    return torch.rand((tokens, E), device=device, generator=g).argsort(dim=1)[:, :k].reshape(-1)[:M].contiguous()


def quantized(shape, dtype, device, g) -> torch.Tensor:
    """Random int8 (within +-127) or e4m3 values."""
    x = torch.randn(shape, device=device, generator=g)
    return (x * 40).round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else (x * 2).to(dtype)


def routed_bytes(ids: torch.Tensor, K: int, N: int, element_size: int) -> int:
    """The weight bytes a call reads: each expert with a row, its [K, N] once."""
    return ids.unique().numel() * K * N * element_size


def make_call(dtype, w, M, k, device, g, tiles=None, gated=False):
    """A call of the op on new rows and routing; with its float reference and routed bytes.
    ``gated``: bf16 gate and up rows, their SiLU-mul quantized per row in the launch
    (``scaled_grouped_mm_dynamic``'s), against the float product of the SiLU-mul."""
    E, N, K = w.shape
    ids = routing(M, E, k, device, g)
    sb = torch.rand((E, N), device=device, generator=g) * 0.02 + 0.001
    b = w.transpose(1, 2)
    if gated:
        up, gate = (torch.randn((M, K), device=device, generator=g).to(BF16) for _ in range(2))
        a, sa = torch.nn.functional.silu(gate.float()) * up.float(), torch.ones(M, device=device)
        recipe = Recipe(127.5 if dtype == torch.int8 else 448.0, torch.finfo(torch.float32).eps, None, gate)

        def call():
            return launch_scaled_grouped_mm(up, b, None, sb, ids, BF16, tiles=tiles, recipe=recipe)
    else:
        a = quantized((M, K), dtype, device, g)
        sa = torch.rand(M, device=device, generator=g) * 0.02 + 0.001

        def call():
            return launch_scaled_grouped_mm(a, b, sa, sb, ids, BF16, tiles=tiles)

    def reference():  # (an expert at a time: no [M, N, K] gather at prefill sizes)
        out = torch.zeros((M, N), device=device)
        for e in ids.unique().tolist():
            rows = (ids == e).nonzero().reshape(-1)
            out[rows] = (a[rows].float() * sa[rows, None]) @ (w[e].float() * sb[e][:, None]).t()
        return out

    return call, reference, routed_bytes(ids, K, N, 1)


def make_bf16_call(w, M, k, device, g):
    """``torch._grouped_mm`` on rows sorted by expert, with their offsets."""
    E, N, K = w.shape
    ids = routing(M, E, k, device, g).sort().values
    offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
    a = torch.randn((M, K), device=device, dtype=BF16, generator=g)
    b = w.transpose(1, 2)
    return (lambda: torch._grouped_mm(a, b, offs=offs)), routed_bytes(ids, K, N, 2)


def check(call, reference) -> float:
    out, want = call().float(), reference()
    err = ((out - want).norm() / want.norm()).item()
    if not err < TOL:
        raise AssertionError(f"output off its float reference: relative error {err:.3g} (tolerance {TOL})")
    return err


def _wall_us(call, reps: int = 3) -> float:
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def bench_point(proj: str, E, K, N, k, M, device, l2_bytes: int, smoke: bool, sweep: bool, log) -> list[dict]:
    """Rows of one (projection, M): each implementation's us a call and TB/s of routed bytes."""
    g = torch.Generator(device=device).manual_seed(M * 7 + N + K)
    weights = {name: quantized((E, N, K), dt, device, g) for name, dt in DTYPES.items()}
    impls = {f"fusepass {name}": (dt, None, False) for name, dt in DTYPES.items()}
    # (down's rows as gate and up: the row kernel quantizes them, or above its rows quantize_rows_kernel)
    gated = proj == "down"
    if gated:
        impls[GATED] = (torch.int8, None, True)
    if sweep:
        swept = [t for t in SWEEP if t.rows == (M <= GROUPED_ROWS_MAX_M) or not t.rows]
        impls.update({f"{SWEPT}{t}": (torch.int8, t, False) for t in swept})
        if gated:
            impls.update({f"{SWEPT_GATED}{t}": (torch.int8, t, True) for t in swept})
    per_call = E * K * N if M >= E else min(M, E) * K * N  # (bytes a call reads at most)
    copies = 1 if smoke else max(1, min(64, math.ceil(3 * l2_bytes / per_call)))
    rows, graphs, made = [], {}, {}
    for name, (dt, tiles, gates) in impls.items():
        w = weights["int8" if dt == torch.int8 else "fp8"]
        calls = [make_call(dt, w, M, k, device, g, tiles, gates) for _ in range(copies)]
        try:
            err = check(calls[0][0], calls[0][1])
            made[name] = (calls, err)
            if not smoke:
                graphs[name] = bl.Graph(lambda i, calls=calls: calls[i][0], copies)
        except Exception as e:  # reported, not fatal: the table says which path failed
            log(f"  {name} at {proj} M={M} failed: {str(e).splitlines()[0][:120]}")
    if not smoke and device == "cuda":
        bw = weights["int8"].to(BF16)
        bcalls = [make_bf16_call(bw, M, k, device, g) for _ in range(copies)]
        graphs["bf16 torch._grouped_mm"] = bl.Graph(lambda i: bcalls[i][0], copies)
        made["bf16 torch._grouped_mm"] = (bcalls, None)
    us = bl.interleaved_us(graphs, log) if graphs else {n: _wall_us(c[0][0]) for n, (c, _) in made.items()}
    for name, (calls, err) in made.items():
        if us.get(name) is None:
            continue
        read = statistics.mean(c[-1] for c in calls)
        # (the policy's, for the weights' layout: [E, N, K] transposed, contiguous along K)
        dt, tiles, gates = impls.get(name, (None, None, False))
        tiles = tiles or (grouped_tiles(M, N, K, E, True, gates) if name in impls else None)
        tiles = tiles and fitted_stages(tiles, torch.device(device))  # (the stages the launch ran)
        rows.append({"proj": proj, "E": E, "K": K, "N": N, "M": M, "impl": name, "us": round(us[name], 2),
                     "TBps": round(read / us[name] / 1e6, 3), "rel_err": err, "tiles": tiles and str(tiles)})
    return rows


def bench_quantize(E, I, M, device, l2_bytes: int, smoke: bool, sweep: bool, log) -> list[dict]:
    """Rows of ``quantized_rows`` alone on M gated rows of the expert width I (down's rows: the
    SiLU-mul of the halves of a [M, 2I] bf16 output), to int8: us a call and TB/s of the bytes
    read and written, as many copies of the rows a graph as pass 3x L2 (as ``bench_point``'s);
    each output checked against ``quantize_rows`` (scales within 1%, values within one step:
    Triton's exp)."""
    moved = M * I * 2 * 2 + M * I + M * 4  # (gate and up read, int8 rows and fp32 scales written)
    copies = 1 if smoke else max(1, min(64, math.ceil(3 * l2_bytes / moved)))
    g = torch.Generator(device=device).manual_seed(M + I)
    inputs = []
    for _ in range(copies):
        gate, up = (torch.randn((M, 2 * I), device=device, generator=g) * 3).to(BF16).chunk(2, dim=-1)
        inputs.append((up, Recipe(127.5, SCALE_EPS, None, gate)))
    up, recipe = inputs[0]
    want_q, want_s = quantize_rows((torch.nn.functional.silu(recipe.gate) * up).cpu(), torch.int8, 127.5, SCALE_EPS)
    launches = {QUANTIZED: {}}
    if sweep:
        launches.update({f"{QUANTIZED} at {p}x{s} w{w}": dict(piece=p, slots=s, num_warps=w)
                         for p, s, w in (QUANTIZE_SWEEP[:2] if smoke else QUANTIZE_SWEEP)})
    calls, graphs = {}, {}
    for name, kw in launches.items():
        def call(i=0, kw=kw):
            return quantized_rows(inputs[i][0], torch.int8, inputs[i][1], False, **kw)
        q, scale = call()
        if not (torch.allclose(scale.cpu(), want_s.flatten(), rtol=1e-2)
                and ((q.cpu().float() - want_q.float()).abs() <= 1).all()):
            log(f"  {name} at M={M}, I={I} failed: its output is off quantize_rows'")
            continue
        calls[name] = call
        if not smoke:
            graphs[name] = bl.Graph(lambda i, call=call: (lambda: call(i)), copies)
    us = bl.interleaved_us(graphs, log) if graphs else {n: _wall_us(c) for n, c in calls.items()}
    return [{"proj": "quantize", "E": E, "K": I, "N": I, "M": M, "impl": name, "us": round(us[name], 2),
             "TBps": round(moved / us[name] / 1e6, 3), "rel_err": None, "tiles": None}
            for name in calls if us.get(name) is not None]


def print_table(rows: list[dict], log) -> None:
    log("| proj | E | K | N | M | implementation | us | TB/s |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['proj']} | {r['E']} | {r['K']} | {r['N']} | {r['M']} | {r['impl']} | {r['us']:.1f} | {r['TBps']:.2f} |")


def summarize(rows: list[dict]) -> list[str]:
    """Per (projection, M): fusepass int8 / fp8 against bf16 torch._grouped_mm, and the fastest tiles swept
    (``--quantize``: quantize_rows alone, and its fastest pieces swept)."""
    lines = []
    points = dict.fromkeys((r["proj"], r["M"]) for r in rows)
    for proj, M in points:
        at = {r["impl"]: r for r in rows if (r["proj"], r["M"]) == (proj, M)}
        bf16 = at.get("bf16 torch._grouped_mm")
        parts = []
        for name in ("fusepass int8", "fusepass fp8", GATED, QUANTIZED):
            if name in at:
                vs = f", {bf16['us'] / at[name]['us']:.2f}x bf16" if bf16 else ""
                parts.append(f"{name.removeprefix('fusepass ')} {at[name]['us']:.1f} us ({at[name]['TBps']:.2f} TB/s{vs})")
        for prefix, what in ((SWEPT, "tiles"), (SWEPT_GATED, "gated tiles"), (QUANTIZED + " at ", "pieces")):
            swept = sorted((r for n, r in at.items() if n.startswith(prefix)), key=lambda r: r["us"])
            if swept:
                parts.append(f"fastest {what} {swept[0]['impl'].removeprefix(prefix)} {swept[0]['us']:.1f} us")
        lines.append(f"{proj}, M={M}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)), help="comma list of rows (tokens x top-k)")
    p.add_argument("--sweep", action="store_true", help="also time the int8 launch at each tile of SWEEP")
    p.add_argument("--quantize", action="store_true",
                   help="also time quantize_rows_kernel alone on down's gated rows (with --sweep: QUANTIZE_SWEEP)")
    p.add_argument("--out", default=None, help="result folder (default benchmarks/results; --smoke: none)")
    p.add_argument("--smoke", action="store_true", help="one tiny shape, wall-clock timing, any device")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        p.error("needs a CUDA GPU (or --smoke)")
    try:
        shapes = ["smoke"] if args.smoke else [s for s in args.shapes.split(",") if SHAPES[s]]
        ms = SMOKE_MS if args.smoke else [int(m) for m in args.ms.split(",")]
    except (KeyError, ValueError) as e:
        p.error(f"bad --shapes/--ms: {e}")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    log(f"{gpu}, torch {torch.__version__}" + (", smoke run" if args.smoke else ""))
    rows = []
    for shape in shapes:
        for proj, (E, K, N, k) in projections(shape).items():
            for M in ms:
                t0 = time.perf_counter()
                point = bench_point(proj, E, K, N, k, M, device, l2, args.smoke, args.sweep, log)
                rows += [{"shape": shape, **r} for r in point]
                log(f"{shape} {proj} M={M} ({time.perf_counter() - t0:.1f} s)")
        if args.quantize:
            E, K, _, _ = projections(shape)["down"]
            for M in ms:
                point = bench_quantize(E, K, M, device, l2, args.smoke, args.sweep, log)
                rows += [{"shape": shape, **r} for r in point]
    print_table(rows, log)
    log("\n".join(summarize(rows)))
    out = args.out or (None if args.smoke else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    if out:
        os.makedirs(out, exist_ok=True)
        stem = os.path.join(out, f"{gpu.replace(' ', '_')}-{datetime.date.today().isoformat()}-grouped")
        with open(stem + ".json", "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "smoke": args.smoke, "rows": rows}, f, indent=1)
        log(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
