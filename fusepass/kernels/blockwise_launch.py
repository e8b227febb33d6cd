"""Configurations and launch of the block-wise fp8 GEMM (``blockwise.py``), in the traceable
style of ``launch.py`` (whose helpers it uses): eagerly the kernel launches through Triton;
traced (the op inlined by ``fusepass.passes.lower``) each launch is a ``wrap_triton`` node that
Inductor launches from its own code, and a symbolic M picks its bucket's config at run time
through ``launch._by_m``'s ``cond`` chain.

The config table is small and untuned: one config per M bucket, decode (weight-bound, narrow
N tiles for more programs) to prefill (compute-bound, 128x128 tiles). ``benchmarks/
bench_blockwise.py`` measures it against cuBLAS's block-wise ``torch._scaled_mm``.
"""

from __future__ import annotations

import torch
import triton
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true
from torch.library import wrap_triton

from ..ops.checks import BLOCK
from .blockwise import blockwise_mm_kernel
from .configs import Config, fit, merge_buckets
from .launch import GRAPH_SYMBOLS, INTERPRETED, _by_m, _flat, _plain, _traced, new_output, on_device

# (top of the M bucket, config), ascending; the last bucket (top None) takes every larger M.
# BLOCK_K is 128 (one dot per scale group); fit() may halve it for a K below 128.
CONFIGS = (
    (16, Config(16, 32, 128, num_warps=4, num_stages=4)),  # decode: N tiles of 32 keep every SM reading
    (64, Config(32, 64, 128, num_warps=4, num_stages=4)),
    (256, Config(64, 128, 128, num_warps=4, num_stages=3)),
    (None, Config(128, 128, 128, num_warps=8, num_stages=3)),  # prefill
)


def check_config(cfg: Config) -> None:
    """The kernel's constraints on a config: BLOCK_K a power of two dividing 128 (a scale group is
    a whole number of dots) and >= 32 (tl.dot of 8-bit inputs), BLOCK_M/N >= 16, no split-K/TMA."""
    if cfg.block_k not in (32, 64, 128):
        raise ValueError(f"block-wise config: block_k must divide the 128-wide scale groups and be >= 32 "
                         f"(32, 64 or 128); got {cfg.block_k}")
    if min(cfg.block_m, cfg.block_n) < 16:
        raise ValueError(f"block-wise config: block_m and block_n must be >= 16; got {cfg.block_m}, {cfg.block_n}")
    if cfg.split_k != 1 or cfg.tma:
        raise ValueError(f"block-wise config: the kernel has no split-K or TMA path; got split_k={cfg.split_k}, "
                         f"tma={cfg.tma}")


def select_config(M: int, N: int, K: int) -> Config:
    """The config of M's bucket, its tiles shrunk to a small N or K."""
    cfg = next(cfg for top, cfg in CONFIGS if top is None or M <= top)
    return fit(cfg, N, K)


def bucket_choices(N, K) -> list:
    """``[(top, Config)]`` of every bucket, fitted where N and K are numbers, adjacent buckets
    with the same config merged (``_by_m``'s input: one ``cond`` branch per distinct config)."""
    concrete = is_concrete_int(N) and is_concrete_int(K)
    return merge_buckets((top, fit(cfg, int(N), int(K)) if concrete else cfg) for top, cfg in CONFIGS)


def _run(cfg: Config, out_dtype: torch.dtype, a, b, scale_a, scale_b, bias=None):
    """Launch the kernel with one config; returns the new (M, N) output."""
    M, K = a.shape
    N = b.shape[1]
    out = new_output(a, b, out_dtype)
    fake = _traced(a)
    if INTERPRETED and fake:
        return out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    (wrap_triton if fake else _plain)(blockwise_mm_kernel)[grid](
        a, b, out,
        scale_a, scale_b,
        bias,  # None when unused (a constexpr: see launch._run)
        M, N, K,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1),
        scale_a.stride(0), scale_a.stride(1),
        scale_b.stride(0), scale_b.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        GROUP_K=BLOCK,
        EVEN_K=statically_known_true(K % BLOCK == 0),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def launch_scaled_mm_blockwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """Run the block-wise kernel on validated inputs (K >= 1) and return a new (M, N) tensor.

    ``config`` overrides the table (tests, tuning). Works on CUDA tensors, on CPU tensors under
    TRITON_INTERPRET=1, and traced (a symbolic M picks its bucket at run time)."""
    M, K = a.shape
    N = b.shape[1]
    if statically_known_true(M == 0) or statically_known_true(N == 0):
        return torch.empty((M, N), dtype=out_dtype, device=a.device)
    fake = _traced(a)
    bias = _flat(bias, fake)
    if config is not None:
        check_config(config)
    elif all(map(is_concrete_int, (M, N, K))):  # eager, or a static trace
        config = select_config(int(M), int(N), int(K))
    tensors = (a, b, scale_a, scale_b) + ((bias,) if bias is not None else ())
    if config is not None:
        def launch():
            return _run(config, out_dtype, *tensors)
    else:  # a symbolic size: the config of M's bucket, picked at run time
        def launch():
            return _by_m(bucket_choices(N, K), lambda cfg, *ts: _run(cfg, out_dtype, *ts), tensors,
                         GRAPH_SYMBOLS.get())
    return on_device(a, fake, launch)
