"""Configuration and launch of the grouped GEMM (``group.py``), in the traceable style of
``launch.py``: eagerly the kernel launches through ``direct.DirectLauncher``; traced (the op inlined by
``fusepass.passes.lower``) the launch is a ``wrap_triton`` node Inductor launches itself.

The config is the tuned one of the fused weight the members make together, (M, sum N_i, K):
that is the GEMM the launch runs (Llama-3-8B's q/k/v make the 6144 x 4096 weight the table
has), with its split of K where a decode launch may split (``policy.decode_splits``) and
pointer loads, whatever the table says for that shape (``group.py``); at M = 1 with the
weights as stored, the M = 1 kernel's rows (``configs.gemv_config``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from .configs import Config, cdiv, fit, gemv_config, gemv_fills, select_config, sm_count
from .direct import launcher
from .group import scaled_mm_group_kernel
from .launch import INTERPRETED, dp4a_rows, flat, gemv_allowed, on_device, split_k_buffers, traced
from .policy import MAX_MEMBERS, NO_GRAPHS, Graphs, decode_splits, per_element


def takes_gemv(M: int, Ns: list, k_contiguous: bool, device) -> bool:
    """Whether a group runs the M = 1 kernel's rows: one row, the weights' columns
    ``k_contiguous`` (``w.t()``), and the members together filling the GPU (``gemv_fills``),
    as one weight of their joined width would."""
    return M == 1 and k_contiguous and gemv_fills(sum(Ns), device)


def group_config(M: int, Ns: list, K: int, dtype: torch.dtype, device, *, k_contiguous: bool,
                 split_decode: bool = True) -> Config:
    """The tuned config of (M, sum(Ns), K) with pointer loads, fitted to the widest member
    (``split_decode`` as in ``select_config``); ``gemv_config``'s for the joined width where
    the group ``takes_gemv``."""
    if takes_gemv(M, Ns, k_contiguous, device):
        return gemv_config(sum(Ns), K, sm_count(device), dtype)
    cfg = select_config(M, sum(Ns), K, dtype, device, split_decode=split_decode)
    return fit(replace(cfg, tma=False, persistent=False), max(Ns), K)


def launch_scaled_mm_group(
    a: torch.Tensor,
    bs: list,
    scale_a: torch.Tensor,
    scale_bs: list,
    out_dtype: torch.dtype,
    biases: list,
    config: Config | None = None,
    graphs: Graphs = NO_GRAPHS,
) -> list:
    """Run the grouped kernel on validated inputs (K >= 1, a static M, 2..4 members of one
    weight layout and epilogue variant) and return the new (M, N_i) outputs. ``config``
    overrides the table (tests); ``graphs``: where traced launches will run
    (``policy.decode_splits``)."""
    M, K = a.shape
    Ns = [b.shape[1] for b in bs]
    outs = [torch.empty_strided((M, N), (N, 1), dtype=out_dtype, device=a.device) for N in Ns]
    fake = traced(a)
    if statically_known_true(M == 0) or (INTERPRETED and fake):
        return outs
    if not all(map(is_concrete_int, (M, K, *Ns))):
        raise ValueError("fusepass.scaled_mm_group: sizes must be static (the pass groups static decode sizes)")
    cfg = config or group_config(int(M), [int(n) for n in Ns], int(K), a.dtype, a.device,
                                 k_contiguous=bs[0].stride(0) == 1,
                                 split_decode=decode_splits(fake, False, graphs))
    if cfg.gemv and (not gemv_allowed(a, bs[0]) or cfg.split_k != 1):
        raise ValueError(f"a gemv config needs M = 1, weights contiguous along K and split_k 1, got M = {M}, "
                         f"strides {tuple(bs[0].stride())}, split_k {cfg.split_k}")
    scale_a = flat(scale_a, fake)
    scale_bs = [flat(s, fake) for s in scale_bs]
    biases = [flat(b, fake) for b in biases]
    pad = [None] * (MAX_MEMBERS - len(bs))
    grid = (cdiv(M, cfg.block_m) * sum(cdiv(N, cfg.block_n) for N in Ns), cfg.split_k)
    even_k = statically_known_true(K % cfg.block_k == 0)
    acc_dtype = torch.int32 if a.dtype == torch.int8 else torch.float32
    partial, tickets = split_k_buffers(cfg.split_k, grid[0], M, sum(Ns), acc_dtype, a.device, fake)

    def launch():
        launcher(scaled_mm_group_kernel, fake)[grid](
            a, scale_a,
            *bs, *pad,
            *outs, *pad,
            *scale_bs, *pad,
            *biases, *pad,
            partial, tickets,
            M, K,
            *Ns, *([0] * len(pad)),
            a.stride(0), a.stride(1),
            bs[0].stride(0), bs[0].stride(1),
            SCALE_A_PER_TOKEN=per_element(scale_a),
            SCALE_B_PER_CHANNEL=per_element(scale_bs[0]),
            HAS_BIAS=biases[0] is not None,
            MEMBERS=len(bs),
            GEMV=cfg.gemv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=even_k,
            SPLIT_K=cfg.split_k,
            DP4A=cfg.gemv and all(dp4a_rows(b, cfg.block_k, even_k, fake) for b in bs),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return outs

    return on_device(a, fake, launch)
