"""A whole model, as a user runs it: step time, GPU kernel time and compile time per cell.

    python benchmarks/bench_model.py                                  # Llama-3-8B's full size
    python benchmarks/bench_model.py --layers 8,16,32 --variants bf16,int8 --steps b1
    python benchmarks/bench_model.py --report results/model.json --plot results/model.png

The model is the demo's random transformers ``LlamaForCausalLM`` (``fusepass/demo/models.py``)
at Llama-3-8B's size (32 layers, hidden 4096, intermediate 14336, 32/8 heads, vocab 128256),
or with ``--shape qwen3-8b`` a ``Qwen3ForCausalLM`` at Qwen3-8B's (36 layers, intermediate
12288, vocab 151936, q/k norms), or a mixture of experts at Qwen3-30B-A3B's (``qwen3-30b-a3b``:
48 layers, 128 experts, top-8, expert width 768) or OLMoE-1B-7B's (``olmoe-1b-7b``), its bf16
experts run by transformers' ``--experts-impl`` and its W8A8 ones (``moe-int8``, ``moe-fp8``) by
``fusepass.quantize_experts``, or as torchao's fp8 weights by transformers' own code
(``moe-fp8-torchao``); ``--layers`` deep, lm_head in bf16. Variants (``VARIANTS``): bf16 under stock
``torch.compile``; torchao's W8A8 under stock ``torch.compile``; torchao's W8A8 through
``fusepass.prepare`` and ``backend="fusepass"``; the same without ``prepare``; the
hand-written form (``demo/handwritten.py``) under fusepass; a compressed-tensors checkpoint
(W8A8, FP8_DYNAMIC) as transformers runs it (FP8 also loaded from disk with its
``use_optimized_inference=True``), and through ``prepare`` and fusepass (also W8A8 with
asymmetric activations, and FP8_BLOCK); transformers' own FP8 modules (native FP8 in
128x128 blocks, Meta's FBGEMM FP8) through ``prepare`` and fusepass. Any variant's name + ``-frozen`` (``FROZEN``): compiled
with Inductor's freezing, the weights held as constants, beside the plain variants. Steps:
prefill of ``--prefill`` tokens (``logits_to_keep=1``) and one decode step at batch 1, 16, 64
against a ``--cache``-slot ``StaticCache``. Modes: default and CUDA graphs (``reduce-overhead``),
and eager (not compiled; ``compile_s`` is then the first call's time).

Per cell (variant, mode, step), with ``dynamic=False``; the variants of one (mode, step) are
compiled and warmed one after another, then timed in alternating rounds (``ROUNDS``), so a
drift of the machine's speed, which runs of these machines show, falls on them alike (where
their decode caches fit in memory together; else one variant after another):
- ``compile_s``: the first call (compile and run), wall time (``--profile-compile DIR``: under
  cProfile, its stats in DIR);
- ``step_ms``: the median of ``--calls`` calls after 5, CUDA events around each call (host time
  included, as a user's loop sees it);
- ``kernel_ms`` and ``kernels``: the GPU kernels' time and count per call (``torch.profiler``,
  over 5 calls), and ``gap_ms`` = ``step_ms - kernel_ms``: the time the GPU waits on the host
  (``--profile-steps DIR``: what the host does in 5 steps, by cProfile, and the kernels by
  name, in DIR);
- ``gemm_ms``: of it, fusepass's GEMM kernels (``FUSED_GEMMS``), and at decode ``gemm_TBps``:
  the decoder's linear weights (1 byte each; lm_head apart) over that time, the read rate that
  issue 35's bandwidth target asks of a step's GEMMs (in default mode the M = 1 launches of
  o_proj and down_proj also quantize, and gate, their rows: more time for the same bytes).

Each run appends its rows to ``--out`` (one JSON list, a ``run`` id per process), so a full table
can be built over several calls; ratios are only ever taken within one run (one process).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import os
import statistics
import sys
import time
import uuid
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fusepass  # noqa: E402
from fusepass.demo import models  # noqa: E402
from fusepass.kernels import GEMM_KERNELS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from guard_filters import GUARD_FILTERS  # noqa: E402  (--guard-filter)
from model_results import append, load, plot, report  # noqa: E402  (the results list: --out, --report)

# fusepass's GEMM kernels, by the names their launches carry in a profile (Inductor's too, which
# may add a suffix)
FUSED_GEMMS = tuple(k.fn.__name__ for k in GEMM_KERNELS)

FULL = models.Sizes(32, 4096, 14336, 32, 8, 128256)  # Llama-3-8B
SHAPES = {"llama3-8b": FULL, "qwen3-8b": models.Sizes(36, 4096, 12288, 32, 8, 151936, "qwen3"),
          # mixtures of experts: layers, hidden, (dense width, unused), heads, kv heads, vocab, experts, top-k, width
          "qwen3-30b-a3b": models.Sizes(48, 2048, 6144, 32, 4, 151936, "qwen3_moe", 128, 8, 768),
          "olmoe-1b-7b": models.Sizes(16, 2048, 1024, 16, 16, 50304, "olmoe", 64, 8, 1024)}
# name: (quantization, quantizer, backend, prepare)
VARIANTS = {
    "bf16": (None, None, "inductor", False),
    "int8-stock": ("int8", "torchao", "inductor", False),
    "fp8-stock": ("fp8", "torchao", "inductor", False),
    "int8": ("int8", "torchao", "fusepass", True),
    "int8-asym": ("int8-asym", "torchao", "fusepass", True),
    "fp8": ("fp8", "torchao", "fusepass", True),
    "int8-unprepared": ("int8", "torchao", "fusepass", False),
    "int8-handwritten": ("int8", "handwritten", "fusepass", False),
    # a compressed-tensors checkpoint as transformers runs it, and through prepare + fusepass
    "ct-int8": ("int8", "compressed-tensors", "inductor", False),
    "ct-fp8": ("fp8", "compressed-tensors", "inductor", False),
    "ct-int8-fusepass": ("int8", "compressed-tensors", "fusepass", True),
    "ct-fp8-fusepass": ("fp8", "compressed-tensors", "fusepass", True),
    "ct-int8-asym-fusepass": ("int8-asym", "compressed-tensors", "fusepass", True),
    "ct-fp8-block-fusepass": ("fp8-block", "compressed-tensors", "fusepass", True),  # widths of 128s
    # transformers' own FP8 modules (the native format's FP8Linear, 128x128 blocks; Meta's FBGEMM
    # FP8 as FbgemmFp8Linear), through prepare + fusepass: transformers runs neither offline
    "native-fp8-block-fusepass": ("fp8-block", "transformers", "fusepass", True),
    "fbgemm-fp8-fusepass": ("fp8", "fbgemm", "fusepass", True),
    # a mixture of experts (--shape qwen3-30b-a3b, olmoe-1b-7b): its experts by quantize_experts
    # (fusepass.scaled_grouped_mm), attention's linears by torchao, through prepare + fusepass
    "moe-int8": ("int8", "experts", "fusepass", True),
    "moe-fp8": ("fp8", "experts", "fusepass", True),
    "moe-fp8-block": ("fp8-block", "experts", "fusepass", True),  # as a native FP8 MoE checkpoint: 128x128 blocks
    # the same model in torchao's fp8 per row alone (experts' 3-D weights too), transformers' experts
    # code under stock torch.compile: the PyTorch-native W8A8 MoE path
    "moe-fp8-torchao": ("fp8", "torchao-experts", "inductor", False),
    # the FP8_DYNAMIC checkpoint written to disk and loaded by transformers with
    # use_optimized_inference=True (row-wise F.scaled_mm on GPUs with fp8; elsewhere transformers
    # falls back to ct-fp8's route); in a process of its own (ALONE)
    "ct-fp8-optimized": ("fp8", "transformers-fp8", "inductor", False),
}
# transformers' compressed-tensors modules: offload wrappers whose forward breaks the graph
BREAK_GRAPHS = {"ct-int8", "ct-fp8", "ct-fp8-optimized"}
# Variants timed in a process of their own: with the checkpoint loaded beside it, the bf16
# model compiled first in the process still ran 40.4 ms a b16 step in 1,336 kernels, against
# 10-11 ms in 741 (H200, 32 layers; the cause, inside transformers' loading, not found).
ALONE = {"ct-fp8-optimized"}
# A variant's name + FROZEN: compiled with Inductor's freezing (for models whose weights do not
# change after the compile; docs/PERFORMANCE.md), timed beside the plain ones in one process.
FROZEN = "-frozen"
# eager: no torch.compile (a user of transformers' own quantized paths may not compile)
MODES = {"default": None, "graphs": "reduce-overhead", "eager": None}
STEPS = ("prefill", "b1", "b16", "b64")


def unfrozen(variant: str) -> str:
    """The VARIANTS name of ``variant`` (which may end with FROZEN)."""
    return variant.removesuffix(FROZEN)


def _freezing(variant: str):
    """Inductor's freezing config for ``variant``'s calls: Dynamo reads it as it traces (the first
    call), and so would a recompile in a later one."""
    return torch._inductor.config.patch(freezing=variant.endswith(FROZEN))


def _csv(text: str, known, what: str, name=lambda x: x) -> list:
    items = [x for x in text.split(",") if x]
    unknown = [x for x in items if name(x) not in known]
    if unknown or not items:
        raise SystemExit(f"bench_model: {what}: unknown {unknown or text!r}; known: {', '.join(map(str, known))}")
    return items


def build(variant: str, base, log=print):
    """The model of ``variant`` from the bf16 ``base`` (a copy; lm_head kept bf16)."""
    quant, quantizer, _, prep = VARIANTS[unfrozen(variant)]
    if quant is None:
        return base
    if quantizer == "transformers-fp8":
        return _loaded_optimized(base)
    head = base.lm_head
    base.lm_head = torch.nn.Identity()  # (not copied, not quantized)
    try:
        model = models.quantized_copy(base, quant, quantizer)
    finally:
        base.lm_head = head
    model.lm_head = head
    if prep:
        log(str(fusepass.prepare(model)))
    return model


def _loaded_optimized(base):
    """``base`` as a compressed-tensors FP8_DYNAMIC checkpoint (lm_head left bf16) on disk,
    loaded back by ``from_pretrained`` with ``use_optimized_inference=True``: transformers
    offers that path for checkpoints it loads, not for a model in memory."""
    import tempfile

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = copy.deepcopy(base)
    compressor = models.compressed_tensors(model, models.CT_SCHEMES["fp8"])
    with tempfile.TemporaryDirectory() as path:
        models.save_compressed(model, compressor, path)
        del model
        loaded = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(use_optimized_inference=True))
    return loaded.to(base.device).eval()


def _compiled(model, variant: str, mode: str, guard_filter: str | None = None):
    backend = VARIANTS[unfrozen(variant)][2]
    if mode == "eager":
        return model
    options = {}
    if guard_filter is not None:
        options["guard_filter_fn"] = GUARD_FILTERS[guard_filter](model)
    if variant.endswith(FROZEN):
        # Dynamo reads the global config as it traces (``_freezing``); the option also makes this
        # torch.compile unequal to the plain variant's: an equal one would be served the plain
        # variant's compiled code (run 31, call 4: the frozen rows ran the plain code).
        options["freezing"] = True
    if not options:
        return torch.compile(model, backend=backend, mode=MODES[mode], dynamic=False)
    # torch.compile takes a mode or options, not both: the mode's options, and these
    from torch._inductor import list_mode_options

    return torch.compile(model, backend=backend, dynamic=False,
                         options={**(list_mode_options(MODES[mode]) if MODES[mode] else {}), **options})


def _call(fn, model, step: str, ids, cache_len: int):
    if step == "prefill":
        inputs = models.prefill_inputs(ids[:1])
        return lambda: fn(**inputs)
    batch = int(step[1:])
    cache = models.static_cache(model, batch, cache_len)
    inputs = models.decode_inputs(ids[:batch], cache)
    return lambda: fn(**inputs)


def _timed(call, graphs: bool) -> float:
    """ms of one call: CUDA events around it (host time included), or on a CPU the wall time."""
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        call()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _steps(call, graphs: bool, calls: int) -> None:
    """``calls`` calls back to back (a CUDA-graph step each), then wait for the GPU."""
    for _ in range(calls):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled(call, graphs: bool, calls: int = 5, table: str | None = None) -> tuple[float, float, float]:
    """(GPU kernel ms, kernels, ``fused_gemm_ms``) per call, over ``calls`` calls; ``table``: a
    path to write ``kernel_table`` there."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _steps(call, graphs, calls)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in kernels]
    if table:
        with open(table, "w") as f:
            f.write(kernel_table(spans, calls))
    return sum(e.device_time for e in kernels) / 1e3 / calls, len(kernels) / calls, fused_gemm_ms(spans, calls)


def fused_gemm_ms(kernels: list[tuple[str, float, float]], calls: int) -> float:
    """ms a call of the kernels ``(name, start us, end us)`` that are fusepass's GEMMs (``FUSED_GEMMS``)."""
    return sum(end - start for name, start, end in kernels if name.startswith(FUSED_GEMMS)) / 1e3 / calls


def linear_weights(config) -> int:
    """Elements of a Llama's decoder linear weights (q, k, v, o, gate, up, down; lm_head apart);
    of a mixture of experts', those a batch-1 decode step reads: attention's and the top-k routed
    experts' of each layer (a token's k experts are distinct)."""
    h, d = config.hidden_size, models.head_dim(config)
    per_layer = 2 * h * config.num_attention_heads * d + 2 * h * config.num_key_value_heads * d
    if getattr(config, "num_experts_per_tok", None):
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return config.num_hidden_layers * (per_layer + config.num_experts_per_tok * 3 * h * width)
    return config.num_hidden_layers * (per_layer + 3 * h * config.intermediate_size)


def kernel_table(kernels: list[tuple[str, float, float]], calls: int) -> str:
    """The kernels ``(name, start us, end us)`` of ``calls`` steps by name, slowest first: time,
    launches, and the GPU's idle time before them (from the end of all work before each launch
    to its start), each per call. The steps ran back to back (``_profiled``: the host runs
    ahead), so the idle column is the GPU's waiting inside and between steps, not ``gap_ms``
    (timed steps wait for the GPU each); a step's first kernel holds the wait between steps,
    seen ``calls - 1`` times but divided by ``calls`` as the rest."""
    by_name: dict[str, list[float]] = {}
    busy_until = None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        idle = 0.0 if busy_until is None else max(0.0, start - busy_until)
        busy_until = end if busy_until is None else max(busy_until, end)
        row = by_name.setdefault(name, [0.0, 0, 0.0])
        row[0] += end - start
        row[1] += 1
        row[2] += idle
    lines = ["   us/call  launches/call  idle-before us/call  kernel"]
    for name, (us, n, idle) in sorted(by_name.items(), key=lambda item: -item[1][0]):
        lines.append(f"{us / calls:10.1f}  {n / calls:13.1f}  {idle / calls:19.1f}  {name}")
    idle = sum(row[2] for row in by_name.values())
    lines.append(f"{sum(row[0] for row in by_name.values()) / calls:10.1f}  "
                 f"{len(kernels) / calls:13.1f}  {idle / calls:19.1f}  (all)")
    return "\n".join(lines) + "\n"


def _host_profiled(call, graphs: bool, calls: int, path: str) -> None:
    """``calls`` calls under cProfile, the 40 functions of most own time written to ``path``:
    what the host does per step, the GPU's waits in default mode."""
    import cProfile
    import io
    import pstats

    with cProfile.Profile() as prof:
        _steps(call, graphs, calls)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    with open(path, "w") as f:
        f.write(f"{calls} calls\n{text.getvalue()}")


def _first_call(call, graphs: bool, profile: str | None) -> None:
    """The first call (compile and run); ``profile``: under cProfile, its stats written there."""
    if profile is None:
        _timed(call, graphs)
        return
    import cProfile

    with cProfile.Profile() as prof:
        _timed(call, graphs)
    prof.dump_stats(profile)


ROUNDS = 4  # timed rounds per cell group: the variants alternate, so a drift hits them alike


def _error(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _start(model, variant: str, mode: str, step: str, ids, cache_len: int, profile: str | None,
           guard_filter: str | None = None):
    """Compile and warm up one cell: (its row with ``compile_s``, its call), or (the row with
    its error, None)."""
    fn = _compiled(model, variant, mode, guard_filter)
    graphs = mode == "graphs"
    row = {"variant": variant, "mode": mode, "step": step}
    try:
        call = _call(fn, model, step, ids, cache_len)
        with torch.no_grad(), _freezing(variant):
            t = time.perf_counter()
            _first_call(call, graphs, profile)
            row["compile_s"] = round(time.perf_counter() - t, 1)
            for _ in range(5):
                _timed(call, graphs)
    except Exception as e:  # noqa: BLE001  e.g. torch._int_mm needs M > 16 on CUDA
        row["error"] = _error(e)
        return row, None
    return row, call


def cells(built: dict, mode: str, step: str, ids, cache_len: int, calls: int, profiles: dict,
          guard_filter: str | None = None) -> list[dict]:
    """One row per variant of ``built`` (variant: model) at (mode, step): each compiled and
    warmed in turn, then all timed in ROUNDS alternating rounds (``calls`` each in all; the
    median), then profiled. ``profiles``: variant -> (cProfile path of its compile, path prefix
    of its steps' profiles), each or None. ``guard_filter``: a GUARD_FILTERS name, or None."""
    torch.compiler.reset()
    graphs = mode == "graphs"
    # The variants share forward's code object: one compile each, past Dynamo's default limit
    # of 8 (at which a further variant would run eagerly, with a warning only). Those whose
    # modules break the graph go last: the frames after a break recompile once a layer (the
    # attention's, on ``self.layer_idx``: Dynamo's log at 32 layers), past any limit, and such
    # a frame then runs eagerly for every model after.
    order = sorted(built, key=lambda v: unfrozen(v) in BREAK_GRAPHS)
    with torch._dynamo.config.patch(recompile_limit=max(8, len(built) + 1)):
        started = [_start(built[v], v, mode, step, ids, cache_len, profiles.get(v, (None, None))[0], guard_filter)
                   for v in order]
    times: list[list[float]] = [[] for _ in started]
    with torch.no_grad():
        for r in range(ROUNDS):
            for (row, call), ts in zip(started, times):
                if call is None or "error" in row:
                    continue
                try:  # (decode: calls + 5 + 5 + 1 steps fill fewer than cache_len slots)
                    with _freezing(row["variant"]):
                        ts += [_timed(call, graphs) for _ in range(calls * (r + 1) // ROUNDS - calls * r // ROUNDS)]
                except Exception as e:  # noqa: BLE001
                    row["error"] = _error(e)
        for (row, call), ts in zip(started, times):
            if "error" in row:
                continue
            row["step_ms"] = round(statistics.median(ts), 3)
            steps = profiles.get(row["variant"], (None, None))[1]
            if steps:  # (decode: 5 more steps; --cache holds --calls + 11)
                with _freezing(row["variant"]):
                    _host_profiled(call, graphs, 5, steps + "-host.txt")
            if not torch.cuda.is_available():
                continue
            try:
                with _freezing(row["variant"]):
                    kernel_ms, kernels, gemm_ms = _profiled(call, graphs, table=steps and steps + "-kernels.txt")
            except Exception as e:  # noqa: BLE001
                row["error"] = _error(e)
                continue
            row.update(kernel_ms=round(kernel_ms, 3), kernels=round(kernels, 1),
                       gap_ms=round(row["step_ms"] - kernel_ms, 3))
            if gemm_ms > 0:
                row["gemm_ms"] = round(gemm_ms, 3)
                moe_batch = getattr(built[row["variant"]].config, "num_experts_per_tok", None) and step != "b1"
                if step != "prefill" and not moe_batch:  # (decode reads each weight once a step; quantized: a byte each)
                    row["gemm_TBps"] = round(linear_weights(built[row["variant"]].config) / gemm_ms / 1e9, 3)
    return [row for row, _ in started]


def _fit_together(built: dict, step: str, cache_len: int) -> bool:
    """Whether every variant's decode cache fits in half the GPU's free memory at once (else
    they are timed one after another: 6 variants at batch 64 hold 6 x 8.6 GB of Llama-3-8B
    cache beside their weights)."""
    if step == "prefill" or not torch.cuda.is_available():
        return True
    c = next(iter(built.values())).config
    # K and V of every layer, bf16
    cache = 2 * c.num_hidden_layers * int(step[1:]) * c.num_key_value_heads * cache_len * models.head_dim(c) * 2
    return len(built) * cache <= torch.cuda.mem_get_info()[0] / 2


def check_flags(variants: list[str], guard_filter: str | None, modes: list[str]) -> None:
    """Refuse a guard filter or frozen variant that would time something else than it says, or
    an ALONE variant beside others (ValueError)."""
    alone = ALONE & {unfrozen(v) for v in variants}
    if len(variants) > 1 and alone:
        raise ValueError(f"--variants {', '.join(sorted(alone))} runs in a process of its own: "
                         "loading it changes how the other models of the process compile")
    if guard_filter and "eager" in modes:
        raise ValueError("--guard-filter filters torch.compile's guards: the eager mode has none")
    frozen = [v for v in variants if v.endswith(FROZEN)]
    if frozen and "eager" in modes:
        raise ValueError(f"--variants {', '.join(frozen)}: freezing freezes what torch.compile compiles, "
                         "and the eager mode compiles nothing")
    if guard_filter and len(variants) > 1:
        # Measured (H200, 32 layers): with torch's filter the fp8 model matched the int8
        # model's compiled code (its guards on the weights' dtypes were filtered) and ran it.
        raise ValueError("--guard-filter times one variant per process: models of one class share "
                         "compiled code once the guards on their modules are filtered")
    if guard_filter == "skip-prepared-values" and not all(VARIANTS[unfrozen(v)][3] for v in variants):
        raise ValueError("--guard-filter skip-prepared-values needs a variant that fusepass.prepare converts")


def run(layers: list[int], variants: list[str], modes: list[str], steps: list[str], *, prefill: int,
        cache_len: int, calls: int, out: str | None, sizes: models.Sizes = FULL, profile_dir: str | None = None,
        steps_dir: str | None = None, guard_filter: str | None = None, experts_impl: str = "grouped_mm",
        log=print) -> list[dict]:
    """Time every (depth, variant, mode, step) cell; ``sizes``: the model's but for its depth.
    On a CPU (tests: a small ``sizes``) cells have wall times only. ``profile_dir``: each
    cell's first call (the compile) profiled there, ``<layers>-<variant>-<mode>-<step>.prof``;
    ``steps_dir``: its steps, ``<cell>-host.txt`` (cProfile) and ``<cell>-kernels.txt`` (GPU
    kernels by name). ``guard_filter``: compile with that GUARD_FILTERS filter (in each row).
    ``experts_impl``: a mixture of experts' bf16 experts implementation in transformers (in each row)."""
    check_flags(variants, guard_filter, modes)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    meta = {"run": uuid.uuid4().hex[:8], "gpu": torch.cuda.get_device_name() if cuda else "CPU",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "arch": sizes.arch,
            **({"guard_filter": guard_filter} if guard_filter else {}),
            **({"experts_impl": experts_impl} if sizes.arch in models.MOE_ARCHS else {})}
    rows = []
    for depth in layers:
        sizes = dataclasses.replace(sizes, layers=depth)
        rows += _run_depth(sizes, variants, modes, steps, device, prefill, cache_len, calls, meta, out, log,
                           profile_dir, steps_dir, guard_filter, experts_impl)
    return rows


def _run_depth(sizes, variants, modes, steps, device, prefill, cache_len, calls, meta, out, log,
               profile_dir, steps_dir, guard_filter, experts_impl) -> list[dict]:
    with models.quiet_imports(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = models.random_llama(sizes, max(cache_len, prefill), device, 0, experts_impl)
        ids = models.prompt(base, 64, prefill, 0)
        built, unbuilt = {}, {}
        for variant in variants:
            t = time.perf_counter()
            try:
                built[variant] = build(variant, base, log)
            except Exception as e:  # noqa: BLE001  (its rows say why; the other variants still run)
                unbuilt[variant] = _error(e)
                log(f"[{sizes.layers} layers] {variant}: not built: {unbuilt[variant]}")
                continue
            log(f"[{sizes.layers} layers] {variant}: built in {time.perf_counter() - t:.1f} s")
        rows = []
        for mode in modes:
            for step in steps:
                names = {v: f"{sizes.layers}-{v}-{mode}-{step}" for v in variants}
                profiles = {v: (profile_dir and os.path.join(profile_dir, name + ".prof"),
                                steps_dir and os.path.join(steps_dir, name)) for v, name in names.items()}
                together = not built or _fit_together(built, step, cache_len)
                groups = [built] if together else [{v: m} for v, m in built.items()]
                group = [{**meta, "layers": sizes.layers, **row}
                         for subset in groups for row in cells(subset, mode, step, ids, cache_len, calls, profiles, guard_filter)]
                group += [{**meta, "layers": sizes.layers, "variant": v, "mode": mode, "step": step, "error": error}
                          for v, error in unbuilt.items()]
                for row in group:
                    log(f"[{sizes.layers} layers] {row['variant']} {mode} {step}: {_line(row)}")
                if out:
                    append(out, group)
                rows += group
        del built
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _line(row: dict) -> str:
    if "error" in row:
        return row["error"]
    kernels = f" (kernels {row['kernel_ms']:.3f} ms, {row['kernels']:.0f}; gap {row['gap_ms']:.3f})" if "kernels" in row else ""
    if "gemm_ms" in row:
        kernels += f", GEMMs {row['gemm_ms']:.3f} ms" + (f" ({row['gemm_TBps']:.2f} TB/s)" if "gemm_TBps" in row else "")
    return f"{row['step_ms']:.3f} ms{kernels}, compile {row['compile_s']} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                    help="the model's sizes: Llama-3-8B's, Qwen3-8B's (36 layers, intermediate 12288, q/k norms), or "
                         "a mixture of experts': Qwen3-30B-A3B's (48 layers, 128 experts, top-8, width 768; bf16 61 GB) "
                         "or OLMoE-1B-7B's (16 layers, 64 experts, top-8, width 1024); their W8A8 variants: moe-int8, "
                         "moe-fp8, moe-fp8-block, and torchao's moe-fp8-torchao")
    ap.add_argument("--experts-impl", choices=["grouped_mm", "batched_mm", "eager"], default="grouped_mm",
                    help="a mixture of experts' bf16 experts in transformers (the quantized variants run fusepass's)")
    ap.add_argument("--layers", default=None, help="comma list of depths (default: the shape's full depth)")
    ap.add_argument("--variants", default="bf16,fp8-stock,int8,int8-asym,fp8,int8-handwritten",
                    help=f"comma list of {', '.join(VARIANTS)}; any of them + {FROZEN}: compiled with "
                         "Inductor's freezing, the weights held as constants (docs/PERFORMANCE.md)")
    ap.add_argument("--modes", default="default,graphs", help="comma list of default, graphs, eager (not compiled)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill tokens")
    ap.add_argument("--cache", type=int, default=1024, help="StaticCache slots of a decode step")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per cell (median)")
    ap.add_argument("--out", default=None, help="append the rows to this JSON list")
    ap.add_argument("--profile-compile", metavar="DIR", default=None,
                    help="profile each cell's first call (the compile) with cProfile into DIR "
                         "(read with python -m pstats)")
    ap.add_argument("--profile-steps", metavar="DIR", default=None,
                    help="after timing, profile each cell's steps into DIR: the host's functions "
                         "(cProfile) and the GPU's kernels by name")
    ap.add_argument("--guard-filter", choices=sorted(GUARD_FILTERS), default=None,
                    help="compile with this guard_filter_fn (for models whose modules do not change after "
                         "the compile; one variant per process)")
    ap.add_argument("--report", default=None, help="print the tables of this JSON list (no run)")
    ap.add_argument("--plot", default=None, help="with --report: also plot it to this PNG")
    args = ap.parse_args(argv)
    if args.report:
        rows = load(args.report)
        print(report(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
    shape = SHAPES[args.shape]
    try:
        layers = [int(x) for x in (args.layers or str(shape.layers)).split(",")]
    except ValueError:
        ap.error(f"--layers: not a comma list of integers: {args.layers!r}")
    if min(layers) < 1 or min(args.prefill, args.cache, args.calls) < 1:
        ap.error("--layers, --prefill, --cache and --calls must be >= 1")
    variants = _csv(args.variants, VARIANTS, "--variants", unfrozen)
    modes = _csv(args.modes, MODES, "--modes")
    steps = _csv(args.steps, STEPS, "--steps")
    for flag, path in (("--profile-compile", args.profile_compile), ("--profile-steps", args.profile_steps)):
        if path and not os.path.isdir(path):
            ap.error(f"{flag} {path}: no such directory")
    try:
        check_flags(variants, args.guard_filter, modes)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available() and ("graphs" in modes or {"fp8", "fp8-stock"} & {unfrozen(v) for v in variants}):
        ap.error("CUDA graphs and the fp8 variants need a CUDA GPU")
    if args.calls + 11 + (5 if args.profile_steps else 0) > args.cache:
        ap.error(f"--cache ({args.cache}) must hold --calls + 11 decode steps (+ 5 with --profile-steps)")
    rows = run(layers, variants, modes, steps, prefill=args.prefill, cache_len=args.cache, calls=args.calls,
               out=args.out, sizes=shape, profile_dir=args.profile_compile, steps_dir=args.profile_steps,
               guard_filter=args.guard_filter, experts_impl=args.experts_impl)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
