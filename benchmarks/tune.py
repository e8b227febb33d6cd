"""Offline tuning of the fused GEMM's launch configs: writes fusepass/kernels/tuned/<arch>.json.

    python benchmarks/tune.py                          # 8 Llama shapes, every M bucket, every dtype
    python benchmarks/tune.py --shapes 8b --dtypes int8 --buckets 16,4096 --out /tmp/t.json
    python benchmarks/tune.py --grid wide --buckets 1,16,64 --keep-defaults   # M <= 64 over a full grid

For each dtype, M bucket (timed at its largest M; the last bucket at 16384) and (N, K),
every candidate tile of the bucket is timed with and without TMA loads (from M <= 1024 up,
also the persistent kernel's tiles), then the best one is refined over split-K (up to M =
256), and each kernel's best over pipeline depth. ``--grid wide`` instead times, at the buckets up
to M = 64, every config of a product grid of tiles, pipeline depths and splits (pointer
loads; 144 configs at M <= 16, 108 at M <= 64). Timing follows bench_linear.py's protocol
(CUDA graph of calls over rotating input copies > 3x L2, median of replays, then the GPU
idle as long as they ran, so each candidate starts from rest); each
candidate's output must match the built-in default config's before it counts. The fastest
config wins, except at the decode buckets (M <= 16): outside CUDA graphs a decode launch runs
unsplit (``configs.decode_unsplit``), so there the winner minimises the worse of its time over
the best time and its unsplit form's time over the best unsplit time (the row's
``unsplit_us``). The bucket's default for unseen shapes is the grid's candidate with the best
geomean over the tuned shapes (``--keep-defaults`` leaves them: for a run over a few added
shapes). The config the launch takes today is timed as a candidate too (each row's
``before_us``). At M = 1 the launch takes ``kernels/gemv.py``'s kernel where the weight is stored
(N, K) and wide enough (``configs.gemv_fills``): the M <= 1 rows serve the other layouts and
narrower weights. An existing table at --out is updated, not replaced, and keeps its notes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import replace

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_linear
from bench_linear import SHAPES, graph_time_us, make_inputs

from fusepass.kernels import launch_scaled_mm
from fusepass.kernels.configs import (
    BUILTIN,
    M_BUCKETS,
    TABLE_DIR,
    Config,
    decode_unsplit,
    device_arch,
    fit,
    m_bucket,
    pointer_loads_only,
    select_config,
    table_key,
)
from fusepass.kernels.launch import persistent_stages


def _c(bm, bn, bk, warps, stages, group=8):
    return Config(bm, bn, bk, group_m=group, num_warps=warps, num_stages=stages)


# Base tiles per M bucket (index into M_BUCKETS). Decode tiles are short in M and read wide
# K slices; the large-M tiles are the wgmma shapes of Triton's Hopper matmul tutorials.
DECODE = [_c(16, 32, 128, 4, 4), _c(16, 64, 128, 4, 4), _c(16, 128, 128, 4, 4),
    _c(16, 32, 256, 4, 3), _c(16, 64, 256, 4, 3), _c(16, 128, 256, 4, 3)]
BASE = {
    0: DECODE,
    1: DECODE,
    2: [_c(32, 64, 128, 4, 4), _c(64, 64, 128, 4, 4), _c(64, 128, 128, 4, 4),
        _c(64, 64, 256, 4, 3), _c(64, 128, 256, 4, 3), _c(64, 256, 128, 8, 3)],
    3: [_c(64, 128, 128, 4, 4), _c(64, 256, 128, 8, 3), _c(128, 128, 128, 8, 3),
        _c(128, 64, 128, 4, 4), _c(128, 256, 128, 8, 3)],
}
BASE[4] = BASE[5] = BASE[6] = [
    _c(128, 128, 128, 8, 3), _c(128, 128, 128, 8, 4), _c(128, 256, 128, 8, 3),
    _c(256, 128, 128, 8, 3), _c(128, 256, 64, 8, 4), _c(128, 128, 128, 4, 4),
]
# From M <= 1024 up, the persistent kernel (persistent.py) as well, with the tiles whose
# half-tile stores leave room for their stages (a run 19 probe: 256x128 with 4 stages won 6
# of 9 points, 128x256 with 3 stages and whole-tile stores 2; 128x128 with 4 warps was the
# best persistent config at M = 1024). TMA loads only.
PERSISTENT = [replace(_c(bm, bn, 128, w, st), tma=True, persistent=True)
              for bm, bn, w, st in ((256, 128, 8, 4), (128, 256, 8, 4), (128, 256, 8, 3), (128, 128, 4, 4))]
PERSISTENT_MIN_BUCKET = M_BUCKETS.index(1024)
SPLITS = (2, 4, 8)
STAGES = (2, 3, 4, 5)


# --grid wide: full products of tile, depth and split for the buckets up to WIDE_MAX_M. The base
# procedure refines one tile's split, then its depth, and missed faster configs there: the
# fp8 M <= 64 and decode rows of 2026-11-25 came from this grid (benchmarks/NOTES.md run 17,
# steps 3 and 6). Pointer loads only, as everywhere up to M = 64 (POINTER_LOADS_MAX_M).
WIDE_MAX_M = 64
WIDE_DECODE = [Config(16, bn, bk, group_m=8, num_warps=4, num_stages=st, split_k=sk) for bn, bk, st, sk in
               itertools.product((32, 64, 128), (128, 256, 512), (3, 4, 5, 6), (1, 2, 4, 8))]  # M <= 16
WIDE_SMALL = [Config(bm, bn, bk, group_m=8, num_warps=4, num_stages=st, split_k=sk) for bm, bn, bk, st, sk in
              itertools.product((32, 64), (32, 64, 128), (128, 256), (3, 4, 5), (1, 2, 4))]  # M <= 64


def base_candidates(bucket: int) -> list[Config]:
    loads = (False,) if pointer_loads_only(bucket) else (False, True)
    persistent = PERSISTENT if bucket >= PERSISTENT_MIN_BUCKET else []
    return [replace(c, tma=tma) for c in BASE[bucket] for tma in loads] + persistent


def is_wide(bucket: int, grid: str) -> bool:
    return grid == "wide" and bucket_m(bucket) <= WIDE_MAX_M


def grid_candidates(bucket: int, grid: str) -> list[Config]:
    """The configs timed first at a bucket (and precompiled): the wide grid's, or the base tiles."""
    if is_wide(bucket, grid):
        return WIDE_DECODE if bucket_m(bucket) <= 16 else WIDE_SMALL
    return base_candidates(bucket)


def runs_unsplit(bucket: int) -> bool:
    """Whether compiled code outside CUDA graphs drops a split at this bucket (configs.decode_unsplit)."""
    return decode_unsplit(replace(BUILTIN[bucket], split_k=2), M_BUCKETS[bucket], split_decode=False).split_k == 1


def choose(results: dict, bucket: int) -> Config:
    """The config a row gets from ``{Config: us}``: the fastest, except where ``runs_unsplit``:
    there the least worse of (its time / the best time, its unsplit form's / the best unsplit
    time), ties to the faster; a split config whose unsplit form has no time is never chosen."""
    fastest = min(results, key=results.get)
    unsplit = [us for cfg, us in results.items() if cfg.split_k == 1]
    if not runs_unsplit(bucket) or not unsplit:  # no unsplit time at all: nothing to weigh
        return fastest
    best_any, best_unsplit = results[fastest], min(unsplit)

    def worse(cfg):
        return max(results[cfg] / best_any, results.get(replace(cfg, split_k=1), math.inf) / best_unsplit)
    return min(results, key=lambda cfg: (worse(cfg), results[cfg]))


def run(t: dict, dtype: str, cfg: Config) -> torch.Tensor:
    """One call on bench_linear inputs; "int8_azp" tunes the per-token zero point."""
    azp = (t["adj"], t["azp"]) if dtype == "int8_azp" else (None, None)
    return launch_scaled_mm(t["a"], t["b"], t["sa"], t["sb"], torch.bfloat16, t["bias"], *azp, config=cfg)


def inputs(dtype: str, M: int, N: int, K: int, g: torch.Generator) -> dict:
    return make_inputs("int8" if dtype == "int8_azp" else dtype, M, N, K, g)


def _compile(job) -> None:
    """Compile (and run once) one candidate, filling Triton's disk cache. M is 1 or 16:
    Triton compiles M == 1 apart and every other multiple of 16 alike."""
    dtype, cfg, M, N, K = job
    try:
        run(inputs(dtype, M, N, K, torch.Generator(device="cuda").manual_seed(0)), dtype, Config(**cfg))
        torch.cuda.synchronize()
    except Exception as e:  # tune_shape skips it with the same message
        print(f"    compile of {cfg} failed: {type(e).__name__}", file=sys.stderr, flush=True)


def compile_jobs(dtypes, buckets, shapes, grid: str) -> list:
    """``_compile``'s jobs for the built-in and grid candidates, one per distinct kernel."""
    jobs = {}
    for dtype in dtypes:
        for bucket in buckets:
            for N, K in shapes:
                for cfg in [BUILTIN[bucket], *grid_candidates(bucket, grid)]:
                    M = min(16, bucket_m(bucket))
                    key = (dtype, fit(cfg, N, K), M, N % 16 == 0, K % 16 == 0)
                    jobs.setdefault(key, (dtype, fit(cfg, N, K).as_dict(), M, N, K))
    return list(jobs.values())


def precompile(dtypes, buckets, shapes, log, grid: str = "base") -> None:
    """Compile every grid candidate in parallel processes: Triton compiles one kernel at a
    time per process, and tuning ~100 kernels serially spent most of its time compiling."""
    jobs = compile_jobs(dtypes, buckets, shapes, grid)
    workers = min(12, os.cpu_count() or 1)
    log(f"compiling {len(jobs)} kernels in {workers} processes")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(_compile, jobs))


def bucket_m(bucket: int) -> int:
    return M_BUCKETS[bucket] or 16384


def time_config(dtype: str, cfg: Config, sets: list, copies: int) -> float:
    return graph_time_us(lambda i: (lambda t=sets[i]: run(t, dtype, cfg)), copies)


def tune_shape(dtype: str, bucket: int, N: int, K: int, l2_bytes: int, log, grid: str = "base") -> tuple[dict, Config]:
    """us of every candidate at one (dtype, bucket, N, K), ``{Config: us}``, and the kernel config
    that ``select_config`` gives there today, timed among them (what the new row gains over it;
    kept if still the fastest)."""
    M = bucket_m(bucket)
    torch_dtype = torch.int8 if dtype.startswith("int8") else torch.float8_e4m3fn
    current = select_config(M, N, K, torch_dtype, torch.device("cuda"), dtype == "int8_azp")
    copies = max(1, min(64, math.ceil(3 * l2_bytes / (M * K + N * K))))
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    sets = [inputs(dtype, M, N, K, g) for _ in range(copies)]
    t = sets[0]
    ref = run(t, dtype, fit(BUILTIN[bucket], N, K))

    def measure(cfg: Config) -> float:
        out = run(t, dtype, cfg)
        # int8 sums exactly; fp8 split-K adds its slices in another order.
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
        return time_config(dtype, cfg, sets, copies)

    return search(bucket, N, K, grid, measure, log, current), current


def search(bucket: int, N: int, K: int, grid: str, measure, log, current: Config | None = None) -> dict:
    """{Config: us} of the configs tried at one shape, ``current`` among them, ``measure(cfg)``
    timing one (apart from the GPU work, so the procedure is testable)."""
    results: dict[Config, float] = {}

    def trial(cfg: Config):
        cfg = fit(cfg, N, K)
        if cfg in results:
            return
        if cfg.persistent and persistent_stages(cfg, 2, torch.device("cuda")) != cfg:  # (bf16 out, as timed)
            log(f"    skip {cfg}: launch would run it with fewer stages (shared memory)")
            return
        try:
            results[cfg] = measure(cfg)
        except Exception as e:  # too much shared memory, a mismatch: reported, never chosen
            log(f"    skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")

    trial(BUILTIN[bucket])
    if current is not None:
        trial(current)
    for cfg in grid_candidates(bucket, grid):
        trial(cfg)
    if is_wide(bucket, grid):  # the grid holds every split and depth already
        return results
    best = min(results, key=results.get)
    if bucket_m(bucket) <= 256:
        for split in SPLITS:
            trial(replace(best, split_k=split))
    # Each kernel's best tiles get their depth refined: refining only the fastest let a
    # persistent config at 164 us beat a one-tile-per-program one whose 3-stage form runs
    # 147-150 us (int8, M = 1024, N = 10240, K = 8192; run 19, call 7).
    for persistent in sorted({cfg.persistent for cfg in results}):
        best = min((cfg for cfg in results if cfg.persistent == persistent), key=results.get)
        for stages in STAGES:
            trial(replace(best, num_stages=stages))
    if runs_unsplit(bucket):  # choose() weighs the fastest's unsplit form; elsewhere nothing more
        trial(replace(min(results, key=results.get), split_k=1))
    return results


def pick_default(bucket: int, per_shape: dict, grid: str = "base") -> tuple[Config, float]:
    """The grid candidate with the best geomean of (its time / the shape's best time) over
    the tuned shapes: the config for shapes the table has not seen."""
    def score(cfg):
        ratios = [r.get(fit(cfg, N, K), math.inf) / min(r.values()) for (N, K), r in per_shape.items()]
        return math.exp(sum(map(math.log, ratios)) / len(ratios))
    best = min(grid_candidates(bucket, grid), key=score)
    return best, score(best)


def save(table: dict, out: str, argv) -> None:
    # An updated table keeps the commands that wrote it, oldest first.
    meta = table.get("meta", {})
    commands = meta.get("commands", [meta["command"]] if "command" in meta else [])
    command = "python benchmarks/tune.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table["meta"] = {
        "gpu": torch.cuda.get_device_name(), "arch": device_arch(torch.device("cuda")),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
        "commands": commands if commands[-1:] == [command] else commands + [command],
        "timing": f"median of {bench_linear.REPLAYS} CUDA-graph replays, rotating inputs > 3x L2, "
                  "then the GPU idle as long as they ran",
        **({"notes": meta["notes"]} if "notes" in meta else {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8b,70b", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--dtypes", default="int8,fp8,int8_azp", help="int8_azp: int8 with a per-token zero point")
    p.add_argument("--buckets", default=",".join(str(bucket_m(b)) for b in range(len(M_BUCKETS))),
                   help="M values; each tunes the bucket that holds it")
    p.add_argument("--grid", choices=("base", "wide"), default="base",
                   help="wide: buckets up to M = 64 time a full grid of tiles, depths and splits")
    p.add_argument("--replays", type=int, default=10, help="graph replays per candidate (median)")
    p.add_argument("--no-precompile", action="store_true", help="compile in this process only")
    p.add_argument("--out", default=None, help="table path (default: fusepass/kernels/tuned/<arch>.json)")
    p.add_argument("--keep-defaults", action="store_true",
                   help="leave the table's bucket defaults as they are (when tuning a few added shapes: "
                        "a default is chosen over the shapes of this run only)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune.py needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    buckets = sorted({m_bucket(int(m)) for m in args.buckets.split(",")})
    dtypes = args.dtypes.split(",")
    arch = device_arch(torch.device("cuda"))
    out = args.out or str(TABLE_DIR / f"{arch}.json")
    table = {"defaults": {}, "shapes": {}}
    if os.path.exists(out):
        with open(out) as f:
            table = json.load(f)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.0f} s] {msg}", flush=True)

    bench_linear.REPLAYS = args.replays
    if not args.no_precompile:
        precompile(dtypes, buckets, shapes, log, args.grid)
    todo = len(dtypes) * len(buckets) * len(shapes)
    done = 0
    for dtype in dtypes:
        for bucket in buckets:
            per_shape = {}
            for N, K in shapes:
                results, current = tune_shape(dtype, bucket, N, K, l2, log, args.grid)
                best = choose(results, bucket)
                base = fit(BUILTIN[bucket], N, K)
                per_shape[(N, K)] = results
                row = table["shapes"][table_key(dtype, bucket, N, K)] = {
                    "config": best.as_dict(), "us": round(results[best], 2),
                    "builtin_us": round(results[base], 2) if base in results else None,
                    "candidates": len(results),
                    "before_us": round(results[current], 2) if current in results else None,
                }
                if runs_unsplit(bucket):  # what the row's config costs outside CUDA graphs
                    unsplit = results.get(replace(best, split_k=1))
                    row["unsplit_us"] = round(unsplit, 2) if unsplit is not None else None
                done += 1
                log(f"{done}/{todo} {dtype} M={bucket_m(bucket)} N={N} K={K}: {results[best]:.1f} us "
                    f"({results.get(base, math.nan) / results[best]:.2f}x faster than the built-in default"
                    + (f", unsplit {row['unsplit_us']} us" if "unsplit_us" in row else "")
                    + (f"; the table's config before: {row['before_us']} us" if row["before_us"] else "")
                    + f") {best}")
            default, score = pick_default(bucket, per_shape, args.grid)
            log(f"default {table_key(dtype, bucket)}: {default} ({score:.3f}x the per-shape best, geomean)"
                + (" (not written: --keep-defaults)" if args.keep_defaults else ""))
            if not args.keep_defaults:
                table["defaults"][table_key(dtype, bucket)] = {"config": default.as_dict(), "geomean_vs_best": round(score, 3)}
            save(table, out, argv)  # after every bucket: a cut-short run keeps what it measured
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
