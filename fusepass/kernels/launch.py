"""Choose the fused GEMM's configuration and launch its kernels, in code that runs eagerly
and traces into Inductor's graphs alike.

Eager (``torch.ops.fusepass.*`` on real tensors): every size is a number, the config is the
tuned table's for this M (at M = 1 with ``b = w.t()``, ``gemv.py``'s kernel where its programs
fill the GPU: ``gemv_config``), and the kernels launch through ``direct.DirectLauncher`` (Triton's
compiled kernels, without its per-call argument binding).

Traced (an op inlined by ``fusepass.passes.lower`` or decomposed by AOTAutograd, as
``torch.library.triton_op`` does): the same code runs under ``make_fx`` on fake tensors.
Each ``wrap_triton`` launch becomes a ``triton_kernel_wrapper`` node that Inductor compiles
and launches from its own generated code, as it launches its own kernels: no custom-op
dispatch, no input check and no table lookup per call. With a static M the config is chosen
at trace time; with a symbolic M it is a chain of ``cond`` on ``M <= bucket top``, so one
compiled graph runs each M on its own bucket's tiles (a host-side ``if`` in the wrapper).

Either way a kernel launch takes three steps: the config (``select_config`` or ``gemv_config``,
or ``bucket_choices`` and ``by_m`` where a size is symbolic; above FP8_CUBLAS_ABOVE_M an fp8
product may go to cuBLAS instead), the plan (``plan``: kernel, grid and constexprs, from sizes
and layouts alone) and the launch (``_run``, through ``direct.launcher``: a ``DirectLauncher``
eagerly, the kernel itself under the interpreter, a ``wrap_triton`` node traced).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from .._compat import cond_op, is_fake, triton_allocator_unset
from .configs import (Config, bucket_choices, cdiv, device_arch, device_properties, gemv_config, gemv_fills,
                      gemv_gated_config, select_config, sm_count)
from .direct import launcher, record, record_call, split_scratch
from .gemv import scaled_gemv_kernel
from .policy import FP8_CUBLAS_ABOVE_M, GRAPH_SYMBOLS, NO_GRAPHS, Graphs, decode_splits, floors_first, per_element
from .persistent import scaled_mm_persistent_kernel
from .scaled_mm import scaled_mm_kernel

ACC_DTYPES = (torch.int32,)  # out_dtype of fusepass.int_mm: the accumulator, no epilogue
# Under TRITON_INTERPRET=1 the kernels are Python run on the data, not traceable launches:
# on fake tensors (the ops' fake implementation) there is nothing to run.
INTERPRETED = type(scaled_mm_kernel).__name__ == "InterpretedFunction"


def _scratch(size: int, alignment: int, stream):
    """Triton's allocator for the device-made TMA descriptors (128 bytes a program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator where none is set (its default raises at launch). A context
    variable, so per thread; Inductor sets its own before each of its launches."""
    if triton_allocator_unset():
        triton.set_allocator(_scratch)


def flat(t: torch.Tensor | None, fake: bool) -> torch.Tensor | None:
    """A vector argument with contiguous elements: itself where it has them (the kernel
    reads the data pointer; an eager view costs ~3 us), else a contiguous 1-D copy. A
    traced one is always reshaped: its contiguity may be symbolic, and views cost nothing
    in a graph."""
    if t is None or (not fake and t.is_contiguous()):
        return t
    return t.reshape(-1).contiguous()


def _aligned(t: torch.Tensor, row_stride, fake: bool) -> bool:
    """16-byte aligned base and rows. On fake tensors the base is judged by the storage
    offset: Inductor allocates its buffers aligned and copies a misaligned input."""
    size = t.element_size()
    if fake:
        base = statically_known_true(t.storage_offset() * size % 16 == 0)
    else:
        base = t.data_ptr() % 16 == 0
    return base and statically_known_true(row_stride * size % 16 == 0)


def tma_allowed(a: torch.Tensor, b: torch.Tensor, fake: bool = False) -> bool:
    """TMA reads a (M, K) and b.T (N, K): both need unit stride along K, aligned rows."""
    return (
        statically_known_true(a.stride(1) == 1) and statically_known_true(b.stride(0) == 1)
        and _aligned(a, a.stride(0), fake) and _aligned(b, b.stride(1), fake)
    )


def gemv_allowed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """gemv.py's kernel takes one row of ``a`` and a ``b`` whose columns are contiguous along
    K (``w.t()``), K a number (its block is sized to it)."""
    return (statically_known_true(a.shape[0] == 1) and statically_known_true(b.stride(0) == 1)
            and is_concrete_int(a.shape[1]))


def dp4a_rows(b: torch.Tensor, block_k: int, even_k: bool, fake: bool) -> bool:
    """Whether the M = 1 kernel reads ``b``'s columns (rows of ``b.T``) as 4-byte words and
    sums them with PTX's ``dp4a`` (``gemv.py``'s DP4A): int8 on an NVIDIA GPU, compiled (the
    interpreter runs no PTX), whole blocks of at least a word (``even_k``, ``block_k``), rows a
    multiple of 4 bytes apart and the first on a 16-byte boundary: the alignment that an eager launch's
    replay key (``ops/eager.py``) and Inductor's checks of its inputs hold a tensor to, so a
    later call with a weight aligned less cannot reuse the launch. Faster at every Llama-3-8B
    decode shape (docs/PERFORMANCE.md, "Why the code is as it is": "dp4a")."""
    if INTERPRETED or torch.version.hip is not None or b.dtype != torch.int8 or not even_k or block_k < 4:
        return False
    offset = b.storage_offset() if fake else b.data_ptr()
    return statically_known_true(b.stride(1) % 4 == 0) and statically_known_true(offset % 16 == 0)


def traced(t: torch.Tensor) -> bool:
    """A fake tensor (also under functionalization); is_fake costs ~4 us, a type check 0.1."""
    return type(t) is not torch.Tensor and is_fake(t)


def new_output(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The new (M, N) output. Strides spelled out: with a symbolic N, torch.empty's row
    stride is Max(1, N), which cond refuses to merge across its branches on torch 2.11
    ("not a simple accumulative multiplication of sizes")."""
    M, N = a.shape[0], b.shape[1]
    return torch.empty_strided((M, N), (N, 1), dtype=out_dtype, device=a.device)


def on_device(a: torch.Tensor, fake: bool, launch):
    """``launch()`` with ``a``'s device current: Triton launches on the current device."""
    if not fake and a.is_cuda and a.device.index != torch.cuda.current_device():
        with torch.cuda.device(a.device):
            return launch()
    return launch()


CUBLAS = "cuBLAS"  # in a by_m choice list: cuBLAS's GEMM instead of a kernel config


def cuda_at_least(major: int, minor: int) -> bool:
    """Whether this torch was built with CUDA >= major.minor."""
    version = torch.version.cuda
    return version is not None and tuple(int(v) for v in version.split(".")[:2]) >= (major, minor)


def cublas_device(device: torch.device) -> bool:
    """The GPU and CUDA where cuBLAS's fp8 GEMMs were measured and taken (``cublas_layout``)."""
    return device.type == "cuda" and device_arch(device) == "sm90" and cuda_at_least(12, 9)


def cublas_layout(a, b, out_dtype: torch.dtype, bias=None) -> bool:
    """What cuBLAS's fp8 ``torch._scaled_mm`` took in every scaling mode (tensor-wise,
    row-wise, block-wise) on an H200 with torch 2.11 built with CUDA 13.0, on the GPU and CUDA
    where it was measured: sm90, and CUDA >= 12.9 (below
    it torch runs row-wise scales through a CUTLASS kernel of its own, which refuses an fp32
    output, and block-wise ones not at all); a row-major ``a`` and a column-major ``b``
    (``w.t()``) with 16-byte aligned rows at least K apart (not a broadcast), K and N
    multiples of 16, no bias or a 16-byte aligned bf16 bias with a bf16 output (one rounding,
    as the ops' contract says; torch refuses an fp32 bias, and any bias with an fp32 output)."""
    K, N = a.shape[1], b.shape[1]
    fake = traced(a)
    return (
        cublas_device(a.device)
        and statically_known_true(K % 16 == 0) and statically_known_true(N % 16 == 0)
        and tma_allowed(a, b, fake)  # unit stride along K in both, aligned bases and rows
        and statically_known_true(a.stride(0) >= K) and statically_known_true(b.stride(1) >= K)
        and (bias is None or (bias.dtype == out_dtype == torch.bfloat16 and _aligned(bias, 0, fake)))
    )


def cublas_takes_fp8(a, b, scale_a, scale_b, out_dtype: torch.dtype, bias=None, azp_adj=None) -> bool:
    """Whether rows above FP8_CUBLAS_ABOVE_M go to cuBLAS (``_cublas_fp8_mm``): e4m3 operands
    (the op's checks also let int8 through here), no zero point, 16-byte aligned fp32 scales
    (torch takes no other dtype; the alignment of a scale vector was not probed, so not
    assumed), and ``cublas_layout``. Its results matched the kernel's errors against a float64
    product in every such case measured."""
    fake = traced(a)
    return (
        a.dtype == b.dtype == torch.float8_e4m3fn and azp_adj is None
        and scale_a.dtype == scale_b.dtype == torch.float32
        and _aligned(scale_a, 0, fake) and _aligned(scale_b, 0, fake)
        and cublas_layout(a, b, out_dtype, bias)
    )


def _cublas_fp8_mm(out_dtype: torch.dtype, a, b, scale_a, scale_b, bias=None):
    """The fp8 product through cuBLAS: tensor-wise with two one-element scales, else
    row-wise, with the scales as torch takes them there ([M, 1] and [1, N], contiguous; a
    one-element scale beside a vector spread to one, as torch refuses mixed modes)."""
    if per_element(scale_a) or per_element(scale_b):
        M, N = a.shape[0], b.shape[1]
        scale_a = scale_a.reshape(-1, 1).expand(M, 1).contiguous()
        scale_b = scale_b.reshape(1, -1).expand(1, N).contiguous()
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def run_cublas(mm, out_dtype: torch.dtype, *tensors):
    """``mm(out_dtype, *tensors)``, a cuBLAS call; eagerly recorded for repeats
    (``direct.CallReplay``: ``tensors`` must be the op call's own)."""
    out = mm(out_dtype, *tensors)
    if not traced(tensors[0]):
        record_call(mm, (out_dtype, *tensors), out)
    return out


def choices_then(choices: list, limit: int, choice) -> list:
    """``choices`` (``by_m``'s ``[(top, cfg)]``) for M <= ``limit``, then ``choice`` for every
    larger M (a bucket that straddles ``limit``, where adjacent ones were merged, is cut there)."""
    kept = []
    for top, cfg in choices:
        kept.append((top if top is not None and top < limit else limit, cfg))
        if top is None or top >= limit:
            break
    return kept + [(None, choice)]


@dataclass(frozen=True)
class Plan:
    """One launch of the fused GEMM as ``plan`` decides it from the config and the operands'
    sizes and layouts alone: the kernel, its grid and compile-time arguments, and what it
    needs beside its operands. ``_run`` carries it out, eagerly or traced alike."""

    kernel: object  # scaled_mm_kernel, scaled_mm_persistent_kernel or scaled_gemv_kernel
    grid: tuple
    constexprs: dict  # the epilogue's flags, the tiling, and the kernel's own switches
    split_k: int = 1  # > 1: (split_k, M, N) partial slices and a zeroed ticket per tile
    tma: bool = False  # device-made TMA descriptors: Triton's scratch allocator, eagerly

    @property
    def persistent(self) -> bool:
        return self.kernel is scaled_mm_persistent_kernel

    @property
    def gemv(self) -> bool:
        return self.kernel is scaled_gemv_kernel


def plan(cfg: Config, flags: dict, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, fake: bool) -> Plan:
    """The launch of ``cfg`` for ``a @ b`` into ``out`` (``flags``: the epilogue's constexprs):
    TMA where ``cfg`` asks for it and the layouts allow it; the persistent kernel where ``cfg``
    asks for it, TMA can also store ``out`` and two stages fit in shared memory (else the tile
    kernel with the same tiles); the M = 1 kernel where ``cfg.gemv`` (ValueError where
    ``gemv_allowed`` does not hold). Launches nothing and allocates nothing."""
    M, N = a.shape[0], b.shape[1]
    even_k = statically_known_true(a.shape[1] % cfg.block_k == 0)
    tiling = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.gemv:
        if not gemv_allowed(a, b) or cfg.split_k != 1:
            raise ValueError(f"a gemv config needs M = 1, b contiguous along K, a static K and split_k 1, got "
                             f"a {tuple(a.shape)}, b {tuple(b.shape)} with strides {b.stride()}, split_k {cfg.split_k}")
        return Plan(scaled_gemv_kernel, (cdiv(N, cfg.block_n),),
                    {"QUANT": False, "DIVISOR": 1.0, "FLOOR": 0.0, "GATED": False, "FLOOR_FIRST": False,
                     "DP4A": dp4a_rows(b, cfg.block_k, even_k, fake), **flags, **tiling, "EVEN_K": even_k})
    tma = cfg.tma and tma_allowed(a, b, fake)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    tiling.update(BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m)
    persistent = cfg.persistent and tma and cfg.split_k == 1 and _aligned(out, out.stride(0), fake)
    fitted = persistent_stages(cfg, out.element_size(), a.device) if persistent else None
    if fitted is not None:
        sms = sm_count(a.device)
        # Programs past the last tile find no tile: with a symbolic M, launch one per SM.
        grid = (min(sms, tiles) if is_concrete_int(tiles) else sms,)
        return Plan(scaled_mm_persistent_kernel, grid,
                    {**flags, **tiling, "num_stages": fitted.num_stages, "NUM_SMS": sms}, tma=True)
    constexprs = {**flags, **tiling, "SPLIT_K": cfg.split_k, "USE_TMA": tma, "EVEN_K": even_k}
    return Plan(scaled_mm_kernel, (tiles, cfg.split_k), constexprs, split_k=cfg.split_k, tma=tma)


def _run(cfg: Config, flags: dict, out_dtype: torch.dtype, a, b, scale_a, scale_b, bias, azp_adj, azp, gate=None):
    """Launch the kernel of one config (``plan``); returns the new (M, N) output. ``gate``: the
    M = 1 kernel's GATED operand."""
    M, K = a.shape
    N = b.shape[1]
    out = new_output(a, b, out_dtype)
    fake = traced(a)
    if INTERPRETED and fake:
        return out
    p = plan(cfg, flags, a, b, out, fake)
    prepare = _ensure_allocator if p.tma and not fake and a.is_cuda else None
    if prepare is not None:
        prepare()
    # Unused pointers are None: Triton makes them constexprs (no argument to pass), and
    # Inductor gets no second alias of a tensor to clone.
    operands = (a, b, out, scale_a, scale_b, bias, azp_adj, azp)
    partial = tickets = None
    if p.persistent:
        args = (*operands, M, N, K, a.stride(0), b.stride(1), out.stride(0))
    elif p.gemv:
        args = (*operands, gate, N, K, a.stride(1), b.stride(1), out.stride(1))
    else:
        acc_dtype = torch.int32 if a.dtype == torch.int8 else torch.float32
        partial, tickets = split_k_buffers(p.split_k, p.grid[0], M, N, acc_dtype, a.device, fake)
        args = (
            *operands, partial, tickets,
            M, N, K,
            a.stride(0), a.stride(1),
            b.stride(0), b.stride(1),
            out.stride(0), out.stride(1),
        )
    entry = launcher(p.kernel, fake)[p.grid](*args, **p.constexprs)
    if not fake:
        record(entry, p.grid, args, out, None if partial is None else (partial, tickets), prepare)
    return out


def persistent_stages(cfg: Config, out_size: int, device: torch.device) -> Config | None:
    """``cfg`` with as many of its stages as fit the device's shared memory next to the
    persistent kernel's half-tile store buffer, whose size the output's dtype sets (None where
    2 stages do not fit: the tile kernel runs instead). A 256x128 tile with 4 stages fits with
    a bf16 output (224 KB), not with an fp32 one (256 KB of the H200's 227 KB; a torchao
    model's fp32 epilogue output hit it). Triton 3.6 took exactly this plus 32 bytes
    of barriers there; SHARED_MEMORY_RESERVE covers those."""
    store = cfg.block_m * (cfg.block_n // 2) * out_size
    stages = fitting_stages(cfg.num_stages, (cfg.block_m + cfg.block_n) * cfg.block_k, device, store, least=2)
    return None if stages is None else replace(cfg, num_stages=stages)


# GPUs whose Triton dots are mma.sync fed by cp.async: its loop pipeliner keeps a buffer fewer than
# the stages there; a Hopper wgmma (and, by its pipeliner's waits, a Blackwell MMA) reads a buffer a stage
# (Hopper's tiles under 64 rows, on mma.sync, are counted so too: a stage more than they keep).
MMA_SYNC_ARCHS = ("sm80", "sm86", "sm87", "sm89", "sm120", "sm121")


def fitting_stages(stages: int, stage_bytes: int, device: torch.device, fixed: int = 0, least: int = 1) -> int | None:
    """The most of ``stages`` (down to ``least``) whose operand buffers (``stage_bytes`` a stage:
    8-bit operands, a byte an element) and ``fixed`` bytes fit the shared memory a program may take
    on ``device`` (``shared_memory``'s); None where ``least`` do not. A buffer a stage, one fewer on
    MMA_SYNC_ARCHS."""
    limit = shared_memory(device) - SHARED_MEMORY_RESERVE
    spare = 1 if device_arch(device) in MMA_SYNC_ARCHS else 0

    def size(n):
        return (n - spare) * stage_bytes + fixed
    while stages > least and size(stages) > limit:
        stages -= 1
    return stages if size(stages) <= limit else None


SHARED_MEMORY_RESERVE = 1024
HOPPER_SHARED_MEMORY = 232448  # a program's opt-in limit on the H100 and H200


def shared_memory(device: torch.device) -> float:
    """Shared memory a program may take on ``device``: the device's own; Hopper's for a CUDA
    device this process cannot see (fake tensors on a host without one); no limit elsewhere
    (the interpreter)."""
    if device.type != "cuda":
        return float("inf")
    props = device_properties(device)
    return HOPPER_SHARED_MEMORY if props is None else props.shared_memory_per_block_optin


def split_k_buffers(split_k: int, tiles, M, N, acc_dtype: torch.dtype, device, fake: bool):
    """``(partial, tickets)`` of a split-K launch (``scaled_mm.split_k_sum``): the (split_k,
    M, N) slices and one zeroed ticket counter per output tile (traced: buffers Inductor
    allocates, and zeroes, per call; eager: ``direct.split_scratch``); ``(None, None)`` unsplit."""
    if split_k == 1:
        return None, None
    if not fake:
        return split_scratch(split_k, tiles, M, N, acc_dtype, device)
    return (torch.empty((split_k, M, N), dtype=acc_dtype, device=device),
            torch.zeros((tiles,), dtype=torch.int32, device=device))


def by_m(choices: list, run, operands: tuple, symbols: tuple):
    """``run(cfg, *operands)`` with the config of M's bucket (M = rows of ``operands[0]``).

    ``choices`` holds ``(top, cfg)`` in ascending order, the last top None (no bound).
    Buckets that M provably skips are dropped; where M is symbolic and more than one
    remains, a ``cond`` on ``M <= top`` picks at run time."""
    M = operands[0].shape[0]
    choices = [(top, cfg) for top, cfg in choices if top is None or not statically_known_true(M > top)]
    top, cfg = choices[0]
    if top is None or len(choices) == 1 or statically_known_true(M <= top):
        return run(cfg, *operands)
    return cond_choice(M <= top, lambda ops, syms: run(cfg, *ops),
                       lambda ops, syms: by_m(choices[1:], run, ops, syms), operands, symbols)


def cond_choice(pred, if_true, if_false, operands: tuple, symbols: tuple):
    """``if_true(operands, symbols)`` or ``if_false(...)``, as a ``cond`` on the symbolic
    ``pred``. The symbols (GRAPH_SYMBOLS) go in as operands too, so that a branch gets its own
    (``if_false`` may hold another ``cond``)."""
    n = len(operands)
    # Each branch returns a 1-tuple: Inductor's cond lowering zips the node's value with
    # the branch outputs, as torch.cond leaves them (a bare tensor fails its stride check).
    (out,) = cond_op()(
        pred,
        lambda *ops: (if_true(ops[:n], ops[n:]),),
        lambda *ops: (if_false(ops[:n], ops[n:]),),
        (*operands, *symbols),
    )
    return out


def gemv_quantizes(x: torch.Tensor, b: torch.Tensor, gate: torch.Tensor | None = None) -> bool:
    """Where ``launch_gemv_quantized`` runs: an int8 or e4m3 ``b`` on the M = 1 kernel's rows,
    which fill the GPU; a ``gate`` of ``x``'s dtype, shape and strides (the kernel reads both rows
    with one stride)."""
    return (b.dtype in (torch.int8, torch.float8_e4m3fn) and gemv_allowed(x, b) and gemv_fills(int(b.shape[1]), x.device)
            and (gate is None or (gate.dtype == x.dtype and gate.shape == x.shape
                                  and statically_known_true(gate.stride(1) == x.stride(1)))))


def launch_gemv_quantized(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
                          bias: torch.Tensor | None, divisor: float, floor: float,
                          gate: torch.Tensor | None = None, floor_first: bool | None = None) -> torch.Tensor:
    """``x`` (1, K), a float row (or, given ``gate``, ``silu(gate) * x``: ``gemv.py``'s GATED),
    quantized per token to ``b``'s dtype inside the M = 1 kernel (``gemv.py``'s QUANT), times
    ``b`` with scaled_mm's epilogue: one launch where a quantization kernel and
    ``launch_scaled_mm`` take two; the scale's order: ``floors_first(b.dtype, floor_first)``.
    Validated inputs where
    ``gemv_quantizes``; eager, interpreted and traced alike."""
    fake = traced(x)
    scale_b, bias = (flat(t, fake) for t in (scale_b, bias))
    flags = dict(SCALE_A_PER_TOKEN=False, SCALE_B_PER_CHANNEL=per_element(scale_b), HAS_BIAS=bias is not None,
                 AZP=0, RAW_ACC=False, QUANT=True, DIVISOR=float(divisor), FLOOR=float(floor), GATED=gate is not None,
                 FLOOR_FIRST=floors_first(b.dtype, floor_first))
    N, K, sms = int(b.shape[1]), int(x.shape[1]), sm_count(x.device)
    cfg = gemv_config(N, K, sms, b.dtype) if gate is None else gemv_gated_config(N, K, sms)
    return on_device(x, fake, lambda: _run(cfg, flags, out_dtype, x, b, None, scale_b, bias, None, None, gate))


def launch_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    azp_adj: torch.Tensor | None = None,
    azp: torch.Tensor | None = None,
    config: Config | None = None,
    graphs: Graphs = NO_GRAPHS,
) -> torch.Tensor:
    """Run the fused kernel on validated inputs (K >= 1) and return a new (M, N) tensor.

    ``azp_adj`` alone selects the per-tensor zero point, ``azp_adj`` and ``azp`` the
    per-token one. ``out_dtype=torch.int32`` (int8 only, no scales) returns the int32
    accumulator itself. Above FP8_CUBLAS_ABOVE_M rows, an fp8 product that
    ``cublas_takes_fp8`` runs as cuBLAS's ``torch._scaled_mm`` (a symbolic M: one more
    ``cond`` branch). ``config`` overrides the tuned launch configuration and always runs the
    kernel (tests, tuning). Works on CUDA tensors, on CPU tensors under TRITON_INTERPRET=1,
    and traced (``graphs``: where the traced launches will run, ``policy.decode_splits``).
    """
    N = b.shape[1]
    if statically_known_true(a.shape[0] == 0) or statically_known_true(N == 0):
        return torch.empty((a.shape[0], N), dtype=out_dtype, device=a.device)
    fake = traced(a)
    scale_a, scale_b, bias, azp_adj, azp = (flat(t, fake) for t in (scale_a, scale_b, bias, azp_adj, azp))
    flags = dict(
        SCALE_A_PER_TOKEN=per_element(scale_a),
        SCALE_B_PER_CHANNEL=per_element(scale_b),
        HAS_BIAS=bias is not None,
        AZP=0 if azp_adj is None else (1 if azp is None else 2),
        RAW_ACC=out_dtype in ACC_DTYPES,
    )
    M, K = a.shape
    cublas = (config is None and not statically_known_true(M <= FP8_CUBLAS_ABOVE_M)
              and cublas_takes_fp8(a, b, scale_a, scale_b, out_dtype, bias, azp_adj))
    if cublas and statically_known_true(M > FP8_CUBLAS_ABOVE_M):
        config = CUBLAS
    elif config is None and all(map(is_concrete_int, (M, N, K))):  # eager, or a static trace
        split = decode_splits(fake, False, graphs)
        # M = 1 only here: Dynamo specializes sizes 0 and 1, so a traced M = 1 is static (an
        # unbacked or exported M that is 1 at run time takes the tiles of its bucket)
        if gemv_allowed(a, b) and gemv_fills(int(N), a.device):
            config = gemv_config(int(N), int(K), sm_count(a.device), b.dtype)
        else:
            config = select_config(int(M), int(N), int(K), a.dtype, a.device, azp_adj is not None, split)
    # cond takes tensors only: the None arguments stay in the closure, by position.
    args = (a, b, scale_a, scale_b, bias, azp_adj, azp)
    present = [i for i, t in enumerate(args) if t is not None]

    def run(cfg, *tensors):
        full = [None] * len(args)
        for i, t in zip(present, tensors):
            full[i] = t
        if cfg is CUBLAS:  # fp8 without a zero point: a, b, scale_a, scale_b, bias
            return run_cublas(_cublas_fp8_mm, out_dtype, *full[:5])
        return _run(cfg, flags, out_dtype, *full)

    if config is not None:
        def launch():
            return run(config, *(args[i] for i in present))
    else:  # a symbolic size: the config of M's bucket, picked at run time
        split = decode_splits(fake, not is_concrete_int(M), graphs)
        choices = bucket_choices(N, K, a.dtype, a.device, azp_adj is not None, split)
        if cublas:
            choices = choices_then(choices, FP8_CUBLAS_ABOVE_M, CUBLAS)

        def launch():
            return by_m(choices, run, tuple(args[i] for i in present), GRAPH_SYMBOLS.get())

    return on_device(a, fake, launch)
