"""Host cost of quantized linears outside CUDA graphs: what default ``torch.compile``
users pay per linear, on one GPU.

    python benchmarks/bench_host.py                 # writes results/<gpu>-<date>-host.json
    python benchmarks/bench_host.py --ms 1,16,32 --nk 256,4096 --profile prof.txt

A compiled call costs a fixed amount (Dynamo's guards, the wrapper's entry) plus a cost
per kernel it launches. So for each (M, N = K) and implementation this times two compiled
functions of the same input, one with 1 linear and one with ``--linears`` L (independent
weights), back to back (wall time per call, one synchronize per batch of 300 calls, the best
of 5 rounds that alternate the implementations), and reports

- ``per_linear_us``: (time(L) - time(1)) / (L - 1), the host cost one more linear adds;
- ``call_us``: time(1), a whole compiled call of one linear;
- ``gpu_us``: the 1-linear function replayed in a CUDA graph (no host cost), for reference.

Implementations: bf16 ``F.linear`` + bias under ``torch.compile`` (what the user had);
``torch._int_mm`` + epilogue under ``torch.compile`` (Inductor's own int8 path, fails at
M <= 16); the same under ``backend="fusepass"``, static and with a symbolic M (``mark_dynamic``); and
``fusepass.scaled_mm`` called eagerly (no compile: per_linear_us is one op call), next to
bf16 ``F.linear`` called eagerly.

With N = K = 256 the GPU work is a few us, so wall time is the host's; with Llama's 4096
the GPU time shows through. Also: a compile with a symbolic M runs each M on its own
bucket's tiles (its time at M matches a static compile's, not the decode config's), and
the host cost of split-K and TMA configs.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fusepass  # noqa: E402
from fusepass.kernels import configs, launch  # noqa: E402

from bench_linear import graph_time_us  # noqa: E402


def wall_us(fn, n: int = 300, batches: int = 7) -> float:
    """Wall time per call of ``n`` back-to-back calls, the least over ``batches`` (the
    host is shared: other work only ever adds time)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return min(times)


def int8_linear(a, w_t, sa, sw, bias):
    return (torch._int_mm(a, w_t).float() * sa * sw + bias).to(torch.bfloat16)


def bf16_linear(x, w, bias):
    return F.linear(x, w, bias)


def eager_linear(a, w_t, sa, sw, bias):
    return fusepass.scaled_mm(a, w_t, sa, sw, torch.bfloat16, bias)


def inputs(M, N, K, L):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(-128, 127, (M, K), dtype=torch.int8, device="cuda", generator=g)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    sa = torch.rand(M, 1, device="cuda", generator=g) * 0.01
    weights = []
    for _ in range(L):
        weights.append(dict(
            w_t=torch.randint(-128, 127, (N, K), dtype=torch.int8, device="cuda", generator=g).t(),
            sw=torch.rand(1, N, device="cuda", generator=g) * 0.01,
            bias=torch.randn(N, device="cuda", generator=g).to(torch.bfloat16),
            w=torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16),
        ))
    return a, x, sa, weights


def layer_fn(linear, bf16: bool, n: int):
    """A function of n independent linears of one input; its own code object, so that
    Dynamo compiles each (impl, n) apart."""
    if bf16:
        src = "def f(x, ws):\n    return tuple(linear(x, w['w'], w['bias']) for w in ws[:%d])" % n
    else:
        src = "def f(a, sa, ws):\n    return tuple(linear(a, w['w_t'], sa, w['sw'], w['bias']) for w in ws[:%d])" % n
    scope = {"linear": linear}
    exec(compile(src, f"<{linear.__name__} x{n}>", "exec"), scope)
    return scope["f"]


IMPLS = {  # name -> (linear, compile kwargs or None for eager)
    "bf16 F.linear, compiled": (bf16_linear, {}),
    "int8 _int_mm+epilogue, compiled (Inductor)": (int8_linear, {}),
    "fusepass, compiled": (int8_linear, {"backend": "fusepass"}),
    "fusepass, compiled, dynamic M": (int8_linear, {"backend": "fusepass"}),
    "fusepass.scaled_mm, eager": (eager_linear, None),
    "bf16 F.linear, eager": (bf16_linear, None),
}


def measure(M, N, K, L, log, rounds: int = 5) -> list[dict]:
    """Rows of every implementation at one shape. The host's speed drifts within a run (by
    up to 1.7x between runs, benchmarks/NOTES.md run 4): the implementations are timed in
    ``rounds`` alternating rounds, and each keeps its best."""
    torch._dynamo.reset()
    rows, timed = [], {}
    a, x, sa, ws = inputs(M, N, K, L)
    for name, (linear, kw) in IMPLS.items():
        bf16 = linear is bf16_linear
        args = (x, ws) if bf16 else (a, sa, ws)
        if "dynamic" in name:  # M alone: a model's weights stay static under dynamic=True too
            args = (_dynamic_m(a), _dynamic_m(sa), ws)
        row = dict(M=M, N=N, K=K, impl=name, linears=L)
        rows.append(row)
        try:
            fns = [layer_fn(linear, bf16, n) for n in (1, L)]
            if kw is not None:
                fns = [torch.compile(f, **kw) for f in fns]
            one, many = (lambda f=f, args=args: f(*args) for f in fns)
            if not bf16 and M > 16:  # vs Inductor's own path (torch._int_mm needs M > 16)
                ref = int8_linear(a, ws[0]["w_t"], sa, ws[0]["sw"], ws[0]["bias"])
                torch.testing.assert_close(one()[0].float(), ref.float(), rtol=2e-2, atol=1e-2)
            many()
            row["gpu_us"] = graph_time_us(lambda i: one, 10)
            timed[name] = (one, many)
        except Exception as e:  # e.g. torch._int_mm needs M > 16 on CUDA
            row["error"] = str(e).strip().splitlines()[0][:120]
    best = {name: (float("inf"), float("inf")) for name in timed}
    for _ in range(rounds):
        for name, (one, many) in timed.items():
            t1, t_many = wall_us(one, batches=1), wall_us(many, batches=1)
            best[name] = (min(best[name][0], t1), min(best[name][1], t_many))
    for row in rows:
        if row["impl"] in best:
            t1, t_many = best[row["impl"]]
            row["call_us"], row["per_linear_us"] = t1, (t_many - t1) / (L - 1)
        log(json.dumps(row))
    return rows


def _dynamic_m(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose dim 0 (M) Dynamo traces as a symbol."""
    t = t.clone()
    torch._dynamo.mark_dynamic(t, 0)
    return t


def _dynamic_linear(*args):  # own code objects: Dynamo caches compiles per code object
    return int8_linear(*args)


def _static_linear(*args):
    return int8_linear(*args)


def bucket_check(N, K, log) -> list[dict]:
    """One compile with a symbolic M runs every M on its own bucket's tiles: its GPU time
    at each M matches a static compile's there, not the decode config's."""
    torch._dynamo.reset()
    dynamic = torch.compile(_dynamic_linear, backend="fusepass")
    rows = []
    for M in (16, 4096):
        a, _, sa, ws = inputs(M, N, K, 1)
        args = (_dynamic_m(a), ws[0]["w_t"], _dynamic_m(sa), ws[0]["sw"], ws[0]["bias"])
        static = torch.compile(_static_linear, backend="fusepass", dynamic=False)
        small = configs.select_config(16, N, K, torch.int8, a.device, split_decode=False)  # as compiled in default mode
        times = {
            "static": graph_time_us(lambda i: (lambda: static(*args)), 10),
            "dynamic": graph_time_us(lambda i: (lambda: dynamic(*args)), 10),
            "decode config forced": graph_time_us(lambda i: (lambda: launch.launch_scaled_mm(
                *args[:4], torch.bfloat16, args[4], config=small)), 10),
        }
        row = dict(M=M, N=N, K=K, **{f"{k} us": round(v, 2) for k, v in times.items()})
        rows.append(row)
        log(json.dumps(row))
    rows.append(dict(frames_compiled=dict(torch._dynamo.utils.counters["stats"])))
    return rows


def config_host_cost(L, log) -> list[dict]:
    """Per-linear host us of compiled calls with split-K and TMA configs forced (M = 16,
    N = K = 256), and the eager op's."""
    rows = []
    a, _, sa, ws = inputs(16, 256, 256, L)
    real = launch.select_config
    for name, cfg in (("plain", configs.Config(16, 64, 64)), ("split_k=4", configs.Config(16, 64, 64, split_k=4)),
                      ("tma", configs.Config(16, 64, 64, tma=True))):
        launch.select_config = lambda *a, cfg=cfg, **k: cfg  # what a static compile asks
        try:
            torch._dynamo.reset()
            one, many = (torch.compile(layer_fn(int8_linear, False, n), backend="fusepass") for n in (1, L))
            # The FX graph cache keys on the graph and the pass's sources, not on this patch: a
            # hit would replay the first config's kernels for the others.
            with torch._inductor.config.patch(fx_graph_cache=False):
                compiled = (wall_us(lambda: many(a, sa, ws)) - wall_us(lambda: one(a, sa, ws))) / (L - 1)
            w = ws[0]
            eager = wall_us(lambda: launch.launch_scaled_mm(a, w["w_t"], sa, w["sw"], torch.bfloat16, w["bias"], config=cfg))
            row = dict(config=name, compiled_per_linear_us=compiled, eager_launch_us=eager)
        finally:
            launch.select_config = real
        rows.append(row)
        log(json.dumps(row))
    return rows


def profile(path: str, L: int) -> None:
    """cProfile of eager op calls and of compiled calls (M = 16, N = K = 256) into ``path``."""
    a, _, sa, ws = inputs(16, 256, 256, L)
    torch._dynamo.reset()
    compiled = torch.compile(layer_fn(int8_linear, False, L), backend="fusepass")
    calls = {"eager fusepass.scaled_mm": lambda: eager_linear(a, ws[0]["w_t"], sa, ws[0]["sw"], ws[0]["bias"]),
             f"compiled, {L} linears": lambda: compiled(a, sa, ws)}
    with open(path, "w") as f:
        for name, fn in calls.items():
            wall_us(fn, n=50, batches=1)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            f.write(f"\n===== {name}: 500 calls =====\n")
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16,32")
    ap.add_argument("--nk", default="256,4096", help="N = K values")
    ap.add_argument("--linears", type=int, default=8)
    ap.add_argument("--parts", default="linears,buckets,configs", help="which measurements, comma list")
    ap.add_argument("--profile", default=None, help="write a cProfile report here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    log = lambda s: print(s, flush=True)  # noqa: E731
    result = dict(gpu=gpu, date=str(datetime.date.today()), torch=torch.__version__,
                  triton=__import__("triton").__version__, rows=[])
    if args.profile:
        profile(args.profile, args.linears)
    parts = args.parts.split(",")
    if "linears" in parts:
        for nk in map(int, args.nk.split(",")):
            for M in map(int, args.ms.split(",")):
                result["rows"] += measure(M, nk, nk, args.linears, log)
    result["buckets"] = bucket_check(4096, 4096, log) if "buckets" in parts else []
    result["configs"] = config_host_cost(args.linears, log) if "configs" in parts else []
    path = args.out or os.path.join(os.path.dirname(__file__), "results",
                                    f"{gpu.replace(' ', '_')}-{result['date']}-host.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nHost us outside CUDA graphs ({gpu}): per linear (L = {args.linears}), a whole 1-linear call, "
          "and the GPU time of that call in a CUDA graph")
    print("| M | N=K | impl | per linear us | call us | gpu us |\n|---|---|---|---|---|---|")
    for r in result["rows"]:
        cell = lambda k: r["error"][:40] if "error" in r else f"{r[k]:.1f}"  # noqa: E731
        print(f"| {r['M']} | {r['N']} | {r['impl']} | {cell('per_linear_us')} | {cell('call_us')} | {cell('gpu_us')} |")
    for r in result["buckets"] + result["configs"]:
        print(r)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
