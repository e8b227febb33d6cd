"""Configurations and launch of the block-wise fp8 GEMM (``blockwise.py``), in the traceable
style of ``launch.py`` (whose helpers it uses): eagerly the kernel launches through
``direct.DirectLauncher``; traced (the op inlined by ``fusepass.passes.lower``) each launch is
a ``wrap_triton`` node that Inductor launches from its own code, and a symbolic M picks its
bucket's config at run time through ``launch.by_m``'s ``cond`` chain.

The config table was tuned on an H200: one tile config per M
bucket, and a split-K that fills the GPU: decode at a small N has too few N tiles to keep
every SM reading (M = 16, N = 576, K = 7168: 33.4 us unsplit, 10.2 us in 8 splits).

At M = 1 with ``b = w.t()``, where its programs fill the GPU, the M = 1 kernel
(``gemv.blockwise_gemv_kernel``, ``gemv_blocks``) runs instead of the tiles: no split K, so no
ticket buffer to zero (a memset launch each call inside CUDA graphs).

Above ``CUBLAS_ABOVE_M`` rows on an sm90 GPU, where the operands are laid out as cuBLAS
takes them and M is a multiple of 4, the product runs as cuBLAS's block-wise
``torch._scaled_mm`` instead (``uses_cublas``, ``CublasChoice``). The Triton kernel, which
waits for the MMA at every 128-wide group to scale it, beats cuBLAS at every measured shape
at M = 16, but is 0.94x its speed at M = 64 (geomean) and 0.52-0.85x from M = 1024 up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from .blockwise import BLOCK, blockwise_mm_kernel
from .configs import Config, cdiv, decode_unsplit, fit, gemv_config, gemv_fills, merge_buckets, sm_count
from .direct import launcher, record
from .gemv import blockwise_gemv_kernel
from .launch import (INTERPRETED, by_m, choices_then, cond_choice, cublas_layout, flat, gemv_allowed, new_output,
                     on_device, run_cublas, split_k_buffers, traced)
from .policy import GRAPH_SYMBOLS, NO_GRAPHS, Graphs, decode_splits

# (top of the M bucket, config, programs per SM, most splits), ascending; the last bucket (top
# None) takes every larger M. BLOCK_K divides 128 (whole dots per scale group); fit() may
# shrink tiles for a small N or K. split_k is derived, not tabled: the splits that give the
# bucket's largest M about ``programs per SM`` x the SM count programs, within the row's most
# splits and one K group each. Measured on an H200 over the 10 Llama-3-8B / DeepSeek-V3
# shapes of bench_blockwise.py: each row is within 1.06x of the best of 12-72 configs tried
# at its M (geomean), the best single config of each M. The two
# decode rows were retuned against the read ceiling: 64-wide tiles read the
# large weights faster (28672 x 4096 at M = 16: 36.6 against 44.3 us with 32-wide tiles, 6
# stages and 6 programs per SM) and lose at the smallest N (576 x 7168 at M = 1: 8.4 against
# 7.5 us); 1.06x (M = 1) and 1.08x (M = 16) faster over the 10 shapes (geomean).
CONFIGS = (
    (1, Config(16, 64, 64, num_warps=4, num_stages=3), 3, 8),
    (16, Config(16, 64, 128, num_warps=4, num_stages=4), 3, 8),
    (64, Config(64, 128, 128, num_warps=4, num_stages=4), 2, 4),
    (256, Config(64, 128, 128, num_warps=4, num_stages=4), 2, 4),
    (1024, Config(64, 128, 128, num_warps=4, num_stages=3), 1, 4),
    (None, Config(64, 128, 128, num_warps=4, num_stages=3), 0, 1),  # 128x128, 8 warps: 1.19-1.21x slower
)


# Above this M, cuBLAS's block-wise GEMM where it applies (``uses_cublas``). H200, torch 2.11
# (cuBLAS of CUDA 13.0), 10 Llama-3-8B / DeepSeek-V3 shapes, CUDA graphs: the Triton kernel is
# 1.21x cuBLAS's speed at M = 16 (geomean; 1.02-1.75x), then
# 0.94x at M = 64 (0.67-1.27x), 0.76x at M = 256 (0.63-1.26x), 0.59-0.66x from M = 1024 up.
# (cuBLAS refuses M = 1.) By M alone: at M = 64, N = 4096, K = 14336 and at M = 256, N = 576,
# K = 7168 cuBLAS takes 1.27x and 1.26x the kernel's time.
CUBLAS_ABOVE_M = 16


@dataclass(frozen=True)
class CublasChoice:
    """The choice for every M above CUBLAS_ABOVE_M: cuBLAS's block-wise GEMM where M is a
    multiple of 4, else the kernel with the config of M's bucket in ``fallback`` (``[(top,
    Config)]``, as ``launch.by_m`` takes them). cuBLAS refused M = 257, 258 and 301
    (CUBLAS_STATUS_NOT_SUPPORTED, H200, torch 2.11), and a ``scale_a`` row stride padded to
    a multiple of 4 ("Invalid scaling configuration"), while 260 and 300 ran: its M-major
    ``scale_a`` rows of M floats are, we take it, to be whole 16 bytes."""

    fallback: tuple


@functools.lru_cache(maxsize=4096)  # on the eager launch path, as configs._config
def _fitted(row: tuple, N: int, K: int, sms: int, split_decode: bool = True) -> Config:
    """The row's config fitted to N and K, with its split-K for ``sms`` SMs (see CONFIGS; at a
    decode bucket only where ``split_decode``: ``configs.decode_unsplit``)."""
    top, cfg, per_sm, most = row
    cfg = fit(cfg, N, K)
    split = 1
    if top is not None and most > 1:
        tiles = cdiv(top, cfg.block_m) * cdiv(N, cfg.block_n)
        split = max(1, min(most, cdiv(K, BLOCK), round(per_sm * sms / tiles)))
    return decode_unsplit(replace(cfg, split_k=split), top, split_decode)


def gemv_blocks(N: int, K: int, device) -> Config:
    """The M = 1 kernel's config (``gemv.blockwise_gemv_kernel``): the per-row kernel's rows and
    bytes a program (``configs.gemv_config``: its rows divide 128, so a program's rows share one
    N block), the block at least one 128-wide group."""
    cfg = gemv_config(N, K, sm_count(device), torch.float8_e4m3fn)
    return replace(cfg, block_k=max(cfg.block_k, BLOCK))


def check_config(cfg: Config) -> None:
    """The kernel's constraints on a config: BLOCK_K a power of two dividing 128 (a scale group is
    a whole number of dots) and >= 32 (tl.dot of 8-bit inputs), BLOCK_M/N >= 16, no TMA; an M = 1
    config (``gemv``): BLOCK_K a multiple of 128, BLOCK_N dividing it."""
    if cfg.gemv:
        if cfg.block_k % BLOCK or BLOCK % cfg.block_n or cfg.split_k != 1:
            raise ValueError(f"block-wise M = 1 config: block_k a multiple of 128, block_n dividing 128 and no "
                             f"split; got {cfg.block_k}, {cfg.block_n}, split_k {cfg.split_k}")
        return
    if cfg.block_k not in (32, 64, 128):
        raise ValueError(f"block-wise config: block_k must divide the 128-wide scale groups and be >= 32 "
                         f"(32, 64 or 128); got {cfg.block_k}")
    if min(cfg.block_m, cfg.block_n) < 16:
        raise ValueError(f"block-wise config: block_m and block_n must be >= 16; got {cfg.block_m}, {cfg.block_n}")
    if cfg.tma:
        raise ValueError("block-wise config: the kernel has no TMA path; got tma=True")
    if cfg.split_k < 1:
        raise ValueError(f"block-wise config: split_k must be >= 1; got {cfg.split_k}")


def select_config(M: int, N: int, K: int, device=None, split_decode: bool = True) -> Config:
    """The config of M's bucket, fitted to N and K, with its split-K (at a decode bucket only
    where ``split_decode``: ``configs.decode_unsplit``)."""
    row = next(row for row in CONFIGS if row[0] is None or M <= row[0])
    return _fitted(row, N, K, sm_count(device), split_decode)


def bucket_choices(N, K, device=None, split_decode: bool = True) -> list:
    """``[(top, Config)]`` of every bucket, fitted where N and K are numbers, adjacent buckets
    with the same config merged (``by_m``'s input: one ``cond`` branch per distinct config);
    ``split_decode`` as in ``select_config``."""
    concrete, sms = is_concrete_int(N) and is_concrete_int(K), sm_count(device)
    return merge_buckets((row[0], _fitted(row, int(N), int(K), sms, split_decode) if concrete else row[1])
                         for row in CONFIGS)


def uses_cublas(a, b, scale_a, scale_b, out_dtype: torch.dtype, bias=None) -> bool:
    """Whether rows above CUBLAS_ABOVE_M go to cuBLAS's block-wise ``torch._scaled_mm``
    (inputs validated by the op's checks): the layouts, dtypes, GPU and CUDA version of
    ``launch.cublas_layout`` (CUDA >= 12.9: earlier builds raise "only supported for CUDA 12.9
    and above"), and ceil(K/128) a multiple of 4: otherwise torch
    2.11's ``_scaled_mm`` returns wrong results, without an error (max error 14-31% of sum
    |a*b| at 1, 5, 11 and 23 K blocks, H200; cuBLASLt reads a 128x128
    ``scale_b`` with its K blocks padded to a multiple of 4, as ``F.scaled_mm`` takes them,
    pytorch/pytorch#166752). The scales go in as cuBLAS takes them (``_cublas_mm``)."""
    return statically_known_true(cdiv(a.shape[1], BLOCK) % 4 == 0) and cublas_layout(a, b, out_dtype, bias)


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """``s`` [R, C] with stride (1, R), as cuBLAS takes block-wise scales: itself, or a copy
    (torch does not check the stride of a size-1 dimension)."""
    R = s.shape[0]
    if statically_known_true(s.stride(0) == 1) and statically_known_true(s.stride(1) == R):
        return s
    return s.t().contiguous().t()


def _cublas_mm(out_dtype: torch.dtype, a, b, scale_a, scale_b, bias=None):
    """The product through cuBLAS's block-wise GEMM (inputs that ``uses_cublas`` accepts)."""
    return torch._scaled_mm(a, b, _outer_major(scale_a), _outer_major(scale_b), bias=bias, out_dtype=out_dtype)


def _cublas_or_kernel(fallback: tuple, out_dtype: torch.dtype, *tensors):
    """cuBLAS's GEMM where M % 4 == 0, else the kernel (``CublasChoice``); a ``cond`` on a
    symbolic M."""
    M = tensors[0].shape[0]

    def kernel(ops, symbols):
        return by_m(list(fallback), lambda cfg, *t: _run(cfg, out_dtype, *t), ops, symbols)

    def cublas(ops, symbols):
        return run_cublas(_cublas_mm, out_dtype, *ops)

    if statically_known_true(M % 4 == 0):
        return cublas(tensors, GRAPH_SYMBOLS.get())
    if statically_known_true(M % 4 != 0):
        return kernel(tensors, GRAPH_SYMBOLS.get())
    return cond_choice(M % 4 == 0, cublas, kernel, tensors, GRAPH_SYMBOLS.get())


def _run(cfg: Config | CublasChoice, out_dtype: torch.dtype, a, b, scale_a, scale_b, bias=None):
    """Launch the kernel with one config (or a ``CublasChoice``); returns the new (M, N) output."""
    if isinstance(cfg, CublasChoice):
        return _cublas_or_kernel(cfg.fallback, out_dtype, *(t for t in (a, b, scale_a, scale_b, bias) if t is not None))
    M, K = a.shape
    N = b.shape[1]
    out = new_output(a, b, out_dtype)
    fake = traced(a)
    if INTERPRETED and fake:
        return out
    if cfg.gemv:
        return _run_gemv(cfg, out, fake, a, b, scale_a, scale_b, bias)
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), cfg.split_k)
    partial, tickets = split_k_buffers(cfg.split_k, grid[0], M, N, torch.float32, a.device, fake)
    args = (
        a, b, out,
        scale_a, scale_b,
        bias,  # None when unused (a constexpr: see launch._run)
        partial, tickets,
        M, N, K,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1),
        scale_a.stride(0), scale_a.stride(1),
        scale_b.stride(0), scale_b.stride(1),
    )
    entry = launcher(blockwise_mm_kernel, fake)[grid](
        *args,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SPLIT_K=cfg.split_k,
        GROUP_K=BLOCK,
        EVEN_K=statically_known_true(K % BLOCK == 0),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not fake:
        record(entry, grid, args, out, None if partial is None else (partial, tickets))
    return out


def _run_gemv(cfg: Config, out, fake: bool, a, b, scale_a, scale_b, bias=None, floor: float | None = None):
    """Launch the M = 1 kernel into ``out`` (``a`` one row, ``b`` contiguous along K); given
    ``floor``, ``a`` is a float row that the kernel quantizes per group (``scale_a`` None)."""
    N, K = b.shape[1], a.shape[1]
    grid = (cdiv(N, cfg.block_n),)
    args = (a, b, out, scale_a, scale_b, bias, N, K, a.stride(1), b.stride(1), out.stride(1),
            0 if scale_a is None else scale_a.stride(1), scale_b.stride(0), scale_b.stride(1))
    entry = launcher(blockwise_gemv_kernel, fake)[grid](
        *args, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=statically_known_true(K % cfg.block_k == 0), GROUP_K=BLOCK,
        QUANT=floor is not None, FLOOR=0.0 if floor is None else float(floor),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fake:
        record(entry, grid, args, out, None)
    return out


def gemv_quantizes_groups(x: torch.Tensor, b: torch.Tensor) -> bool:
    """Where ``launch_gemv_quantized_groups`` runs: an e4m3 ``b = w.t()``, one row of ``x``, and
    programs that fill the GPU (the unquantized M = 1 kernel's rule)."""
    return b.dtype == torch.float8_e4m3fn and gemv_allowed(x, b) and gemv_fills(int(b.shape[1]), x.device)


def launch_gemv_quantized_groups(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
                                 bias: torch.Tensor | None, floor: float) -> torch.Tensor:
    """``x`` (1, K), a float row, quantized per 128-wide group inside the M = 1 kernel
    (``gemv.blockwise_gemv_kernel``'s QUANT), times ``b`` with its 128x128 block scales; inputs
    validated and ``gemv_quantizes_groups``; eager, interpreted and traced alike."""
    fake = traced(x)
    bias = flat(bias, fake)
    out = new_output(x, b, out_dtype)
    if INTERPRETED and fake:
        return out
    cfg = gemv_blocks(int(b.shape[1]), int(x.shape[1]), x.device)
    return on_device(x, fake, lambda: _run_gemv(cfg, out, fake, x, b, None, scale_b, bias, floor))


def launch_scaled_mm_blockwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
    graphs: Graphs = NO_GRAPHS,
) -> torch.Tensor:
    """Run the block-wise product on validated inputs (K >= 1) and return a new (M, N) tensor.

    ``config`` overrides the table (tests, tuning) and always runs the Triton kernel; without
    it, M > CUBLAS_ABOVE_M runs on cuBLAS where ``uses_cublas`` and M % 4 == 0. Works on
    CUDA tensors, on CPU tensors under TRITON_INTERPRET=1, and traced (a symbolic M picks
    its bucket, and cuBLAS or not, at run time; ``graphs``: where the launches will run,
    ``policy.decode_splits``)."""
    M, K = a.shape
    N = b.shape[1]
    if statically_known_true(M == 0) or statically_known_true(N == 0):
        return torch.empty((M, N), dtype=out_dtype, device=a.device)
    fake = traced(a)
    bias = flat(bias, fake)
    use_cublas = (config is None and not statically_known_true(M <= CUBLAS_ABOVE_M)
                  and uses_cublas(a, b, scale_a, scale_b, out_dtype, bias))
    if config is not None:
        check_config(config)
        if config.gemv and not gemv_allowed(a, b):
            raise ValueError(f"block-wise M = 1 config for a {tuple(a.shape)} a and a b of strides {b.stride()}: it "
                             "takes one row and b = w.t() (contiguous along K)")
    elif all(map(is_concrete_int, (M, N, K))):  # eager, or a static trace
        # M = 1 with b = w.t(): the CUDA-core kernel where its programs fill the GPU, as the
        # per-row op's (launch.launch_scaled_mm)
        if gemv_allowed(a, b) and gemv_fills(int(N), a.device):
            config = gemv_blocks(int(N), int(K), a.device)
        else:
            config = select_config(int(M), int(N), int(K), a.device, decode_splits(fake, False, graphs))
        if use_cublas:
            config = CublasChoice(((None, config),))
    tensors = (a, b, scale_a, scale_b) + ((bias,) if bias is not None else ())
    if config is not None:
        def launch():
            return _run(config, out_dtype, *tensors)
    else:  # a symbolic size: the config of M's bucket, picked at run time
        choices = bucket_choices(N, K, a.device, decode_splits(fake, not is_concrete_int(M), graphs))
        if use_cublas:  # one cuBLAS choice above CUBLAS_ABOVE_M, holding those buckets' configs
            upper = tuple((top, cfg) for top, cfg in choices if top is None or top > CUBLAS_ABOVE_M)
            choices = choices_then(choices, CUBLAS_ABOVE_M, CublasChoice(upper))

        def launch():
            return by_m(choices, lambda cfg, *ts: _run(cfg, out_dtype, *ts), tensors, GRAPH_SYMBOLS.get())
    return on_device(a, fake, launch)
