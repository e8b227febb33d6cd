"""Launch of the mixture-of-experts kernels (``grouped.py``): the kernel and tiles of
``policy.grouped_tiles``, the rows' order for the block kernel (``route``), and float rows
quantized before it (``quantized_rows``, ``quantize.py``'s kernel).

Everything here has a shape fixed by M, E and the tile (no host sync, no data-dependent size):
a step captures in a CUDA graph and traces under ``torch.compile``. As the other launches,
eagerly through ``direct.launcher``, traced as a ``wrap_triton`` node Inductor launches itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .blockwise import BLOCK
from .direct import launcher
from .grouped import grouped_gemv_kernel, grouped_mm_kernel, route_count_kernel, route_kernel
from .launch import INTERPRETED, dp4a_rows, fitting_stages, flat, on_device, traced
from .policy import GroupedTiles, floors_first, grouped_tiles
from .quantize import quantize_rows_kernel

ROUTE_CHUNK = 64  # the ids route_kernel reads at a time
# Up to this many rows, route_kernel runs as one program; above, a program a chunk of rows (or a
# span of chunks: ROUTE_MAX_PROGRAMS), after route_count_kernel's counts (a launch more): one
# program was 0.5 us slower at 128 rows, 5.4 at 256 (docs/PERFORMANCE.md, "Mixture of experts":
# "The route"), and a default-mode step is bound by its launches.
ROUTE_ONE_PROGRAM_MAX_M = 128
# Above, at most this many programs, each placing a span of whole chunks: each program reads every
# program's counts, and at 16384 rows 128 programs of 128 rows took 11.3 us against 13.5 for 256 of
# 64 (docs/PERFORMANCE.md, "Mixture of experts": "The route").
ROUTE_MAX_PROGRAMS = 128
# quantized_rows: rows of up to QUANTIZE_BLOCK_K elements read once, held in registers as pieces
# of up to QUANTIZE_PIECE, QUANTIZE_SLOTS pieces a program at least
QUANTIZE_BLOCK_K = 4096
QUANTIZE_PIECE = 256
QUANTIZE_SLOTS = 16


def route_blocks(M, E: int, rows_a_block: int):
    """The blocks of ``route``'s list at M rows: M plus a block's padding for each of the E + 1
    groups, in whole blocks."""
    return (M + (E + 1) * (rows_a_block - 1) + rows_a_block - 1) // rows_a_block


def route(expert_ids: torch.Tensor, E: int, rows_a_block: int, fake: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_experts) of the sorted kernel: the row indices sorted by expert (stable), each
    expert's run padded to whole blocks of ``rows_a_block`` with the sentinel M, in a list of
    fixed length (M plus a block's padding an expert, rounded to blocks); and each block's expert:
    that expert, E for the rows whose id is outside [0, E) (stored as NaN), E + 1 for the unused
    blocks at the end. int32. One launch of ``route_kernel`` up to ROUTE_ONE_PROGRAM_MAX_M rows;
    above, ``route_count_kernel``'s then ``route_kernel``'s, a program a span of chunks of rows (a
    chunk each up to ROUTE_MAX_PROGRAMS chunks)."""
    M, device = expert_ids.shape[0], expert_ids.device
    blocks = route_blocks(M, E, rows_a_block)
    rows = torch.empty((blocks * rows_a_block,), dtype=torch.int32, device=device)
    block_experts = torch.empty((blocks,), dtype=torch.int32, device=device)
    if INTERPRETED and fake:  # (traced under the interpreter, as the grouped launch: the outputs only)
        return rows, block_experts
    groups = triton.next_power_of_2(E + 2)
    sizes = dict(GROUPS=groups, CHUNK=ROUTE_CHUNK, num_warps=4)
    searched = dict(GROUPS_LOG2=groups.bit_length() - 1)
    if statically_known_true(M <= ROUTE_ONE_PROGRAM_MAX_M):
        launcher(route_kernel, fake)[(1,)](expert_ids, None, rows, block_experts, M, E, blocks, M, 1,
                                           BLOCK_M=rows_a_block, COUNTED=False, **sizes, **searched)
        return rows, block_experts
    chunks = torch.sym_max((M + ROUTE_CHUNK - 1) // ROUTE_CHUNK, 1)  # (1 where an unbacked M is 0: no program)
    span = ROUTE_CHUNK * ((chunks + ROUTE_MAX_PROGRAMS - 1) // ROUTE_MAX_PROGRAMS)  # (rows a program places)
    programs = (M + span - 1) // span
    counts = torch.empty((programs, groups), dtype=torch.int32, device=device)
    launcher(route_count_kernel, fake)[(programs,)](expert_ids, counts, M, E, span, **sizes)
    launcher(route_kernel, fake)[(programs,)](expert_ids, counts, rows, block_experts, M, E, blocks, span,
                                              programs, BLOCK_M=rows_a_block, COUNTED=True, **sizes, **searched)
    return rows, block_experts


def launch_route(expert_ids: torch.Tensor, E: int, rows_a_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` as ``fusepass::route_experts`` launches it on CUDA (or under the interpreter)."""
    fake = traced(expert_ids)
    ids = flat(expert_ids, fake)
    return on_device(ids, fake, lambda: route(ids, E, rows_a_block, fake))


@dataclass(frozen=True)
class Recipe:
    """How float rows are quantized in a launch (``ops.grouped_dynamic``: by the row kernel, or by
    ``quantized_rows`` before the sorted blocks): ``quantize_rows``' divisor, floor and order, and
    the gates where the rows are ``silu(gate) * x``."""

    divisor: float
    floor: float
    floor_first: bool | None = None
    gate: torch.Tensor | None = None


def grouped_quantizes(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, expert_ids: torch.Tensor,
                      gate: torch.Tensor | None = None) -> GroupedTiles | None:
    """Where ``launch_scaled_grouped_mm`` takes a float ``x`` and a ``Recipe``, the tiles it takes
    there (else None): an int8 or e4m3 ``b``, scales per channel or per expert (not per block),
    and a gate, if any, of ``x``'s strides (the kernels read both by one set: a MoE layer's gate
    and up, halves of one output, have them); and where ``policy.grouped_tiles`` picks the row
    kernel, ``b`` contiguous along K (its gemv.py loop quantizes; the sorted blocks take rows
    ``quantized_rows`` quantized first)."""
    M, E, K, N = expert_ids.shape[0], b.shape[0], b.shape[1], b.shape[2]
    k_contig = statically_known_true(b.stride(1) == 1)
    if b.dtype not in (torch.int8, torch.float8_e4m3fn) or scale_b.dim() == 3 or not gate_fits(gate, x):
        return None
    tiles = grouped_tiles(M, N, K, E, k_contig, True)
    return None if tiles.rows and not k_contig else tiles


def gate_fits(gate: torch.Tensor | None, x: torch.Tensor) -> bool:
    """No gate, or one of ``x``'s strides: the kernels read both by one set."""
    return gate is None or all(statically_known_true(g == s) for g, s in zip(gate.stride(), x.stride()))


def quantized_rows(x: torch.Tensor, dtype: torch.dtype, recipe: Recipe, fake: bool, piece: int = QUANTIZE_PIECE,
                   slots: int = QUANTIZE_SLOTS, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] of ``dtype``, scale [M] fp32): ``x``'s rows (given ``recipe.gate``, of
    ``silu(gate) * x``) quantized by ``recipe`` (``quantize.quantize_rows_kernel``). A row of up
    to QUANTIZE_BLOCK_K is read once, as pieces of the largest power of two that divides K (16 to
    ``piece`` wide), or where that makes more than ``slots`` pieces, ``piece`` wide; the last one
    masked where K is ragged. As many rows a program as ``slots`` pieces hold (at least one). A
    longer row a program, read twice. (``piece``, ``slots``, ``num_warps``: ``bench_grouped.py --quantize
    --sweep`` and the tests override them.)"""
    M, K = x.shape
    K = int(K)
    if K == 0:
        raise ValueError("quantized_rows: rows of no elements have no scale (K = 0)")
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if K <= QUANTIZE_BLOCK_K:
        block_k = max(min(K & -K, piece), 16)
        if (K + block_k - 1) // block_k > slots:
            block_k = min(piece, triton.next_power_of_2(max(K, 16)))
        pieces = (K + block_k - 1) // block_k
        slots = max(slots, triton.next_power_of_2(pieces))
        rows = slots // pieces
    else:
        block_k, pieces, slots, rows = QUANTIZE_BLOCK_K, 0, 1, 1
    launcher(quantize_rows_kernel, fake)[((M + rows - 1) // rows,)](
        x, recipe.gate, q, scale, M, K, x.stride(0), x.stride(1), DIVISOR=float(recipe.divisor),
        FLOOR=float(recipe.floor), FLOOR_FIRST=floors_first(dtype, recipe.floor_first), GATED=recipe.gate is not None,
        BLOCK_K=block_k, EVEN_K=K % block_k == 0, PIECES=pieces, SLOTS=slots,
        num_warps=num_warps or (4 if pieces else 8))
    return q, scale


def fitted_stages(t: GroupedTiles, device: torch.device) -> GroupedTiles:
    """The sorted-block tiles ``t`` with as many of their stages as fit ``device``'s shared memory
    (a stage: a [block_m, block_k] and a [block_k, block_n] tile of 8-bit operands), at least one;
    the row kernel's as they are."""
    if t.rows:
        return t
    return replace(t, num_stages=fitting_stages(t.num_stages, (t.block_m + t.block_n) * t.block_k, device) or 1)


def launch_scaled_grouped_mm(a, b, scale_a, scale_b, expert_ids, out_dtype, bias=None, row_weights=None,
                             tiles: GroupedTiles | None = None, recipe: Recipe | None = None, routed=None):
    """The op's CUDA path (and, under Triton's interpreter, CPU tensors): inputs validated by
    ``ops.grouped.check_grouped_args``. Returns the new contiguous (M, N) output. ``tiles``
    overrides ``policy.grouped_tiles`` (tests, benchmarks/bench_grouped.py's sweep). ``recipe``
    (where ``grouped_quantizes``): ``a`` is a float [M, K] and ``scale_a`` None; the row kernel
    quantizes its rows itself (``ops.grouped_dynamic``), the sorted blocks take them from
    ``quantized_rows`` (a launch before). ``routed``: ``route``'s (rows, block_experts) of these
    ids, made once for a layer's launches; the sorted blocks take it where its block size is
    theirs (else they route themselves)."""
    T, K = a.shape
    M, E, N = expert_ids.shape[0], b.shape[0], b.shape[2]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    fake = traced(a)
    if statically_known_true(M == 0) or statically_known_true(N == 0) or (INTERPRETED and fake):
        return out
    blocks = scale_b.dim() == 3  # (fp8 with 128x128 block scales: ops.grouped)
    # (the row kernel's gemv.py loop: rows of b.T, contiguous along K; block scales keep the tiles')
    k_contig = not blocks and statically_known_true(b.stride(1) == 1)
    t = tiles or grouped_tiles(M, N, K, E, k_contig, recipe is not None)
    gate = None if recipe is None else recipe.gate
    if recipe is not None and (blocks or not gate_fits(gate, a) or (t.rows and not k_contig)):
        raise ValueError("launch_scaled_grouped_mm: a recipe (float rows quantized in the launch) needs scales per "
                         "channel or per expert, a gate of the rows' strides, and on the row kernel b contiguous "
                         f"along K (grouped_quantizes); got tiles {t}, b strides {tuple(b.stride())}, scale_b "
                         f"{tuple(scale_b.shape)}, rows' strides {tuple(a.stride())}, gate's "
                         f"{None if gate is None else tuple(gate.stride())}")
    if recipe is not None and not t.rows:  # (the rows quantized first, then the sorted blocks take them)
        a, scale_a = on_device(a, fake, lambda: quantized_rows(a, b.dtype, recipe, fake))
        recipe = None
    # (the kernels read the ids, per-row vectors and a row of per-channel values contiguous)
    expert_ids, w = flat(expert_ids, fake), flat(row_weights, fake)
    bias = None if bias is None else bias.contiguous()
    if blocks:
        sa, sb = scale_a, scale_b
        block_strides = (sa.stride(0), sa.stride(1), sb.stride(1), sb.stride(2))
    else:
        sa, sb, block_strides = flat(scale_a, fake), scale_b.reshape(E, -1).contiguous(), (0, 0, 0, 0)
    args = (a, b, out, sa, sb, bias, w)
    share = 1 if statically_known_true(T == M) else M // T  # (routed rows a row of ``a``)
    sizes = (M, N, K, E, share, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), sb.stride(0),
             0 if bias is None else bias.stride(0), *block_strides)
    flags = dict(SCALE_A_PER_ROW=blocks or sa is None or sa.numel() != 1 or T == 1,
                 SCALE_B_PER_CHANNEL=blocks or sb.shape[1] != 1 or N == 1,
                 HAS_BIAS=bias is not None, HAS_ROW_WEIGHTS=w is not None, BLOCK_SCALES=blocks)
    if blocks and t.block_k > BLOCK:  # (a K slice within one group of the scales)
        t = replace(t, block_k=BLOCK)
    t = fitted_stages(t, a.device)
    tiling = dict(BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)

    def launch():
        if t.rows:
            even_k = k_contig and statically_known_true(K % t.block_k == 0)
            # (each expert's rows as aligned as the first's: its stride whole 16-byte lines)
            dp4a = (even_k and statically_known_true(b.stride(0) % 16 == 0)
                    and dp4a_rows(b[0], t.block_k, even_k, fake))
            # (every constexpr named: the direct launcher and wrap_triton take no defaults)
            quant = dict(QUANT=False, DIVISOR=1.0, FLOOR=0.0, GATED=False, FLOOR_FIRST=False) if recipe is None else dict(
                QUANT=True, DIVISOR=float(recipe.divisor), FLOOR=float(recipe.floor), GATED=gate is not None,
                FLOOR_FIRST=floors_first(b.dtype, recipe.floor_first))
            launcher(grouped_gemv_kernel, fake)[(M, triton.cdiv(N, t.block_n))](
                *args, expert_ids, gate, *sizes, **flags, **tiling, K_CONTIG=k_contig, EVEN_K=even_k, DP4A=dp4a,
                **quant)
        else:
            takes = routed is not None and statically_known_true(routed[0].shape[0] == routed[1].shape[0] * t.block_m)
            rows, block_experts = (flat(routed[0], fake), flat(routed[1], fake)) if takes else route(
                expert_ids, E, t.block_m, fake)
            grid = (block_experts.shape[0], triton.cdiv(N, t.block_n))
            launcher(grouped_mm_kernel, fake)[grid](*args, rows, block_experts, *sizes, **flags,
                                                    BLOCK_M=t.block_m, **tiling)
        return out

    return on_device(a, fake, launch)
