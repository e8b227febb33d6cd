"""The fused W8A8 GEMMs of a mixture of experts: each row of ``a`` times its expert's weight.

    out[m, n] = (scale_a[m] * scale_b[e, n] * (a[m] @ b[e])[n] + bias[e, n]) * row_weight[m],
    e = the row's expert

Two kernels, chosen by ``grouped_launch.py``:

- ``grouped_gemv_kernel`` (a few rows: decode): a program a row and ``BLOCK_N`` columns; it
  reads the row's expert id and streams that expert's [K, BLOCK_N] slice of ``b``, so a step
  reads only the routed experts' weights, with no routing work before the launch. Where ``b``
  is contiguous along K (transformers' [E, N, K] experts, transposed) its main loop is the M = 1
  kernel's (``gemv.gemv_rows``: rows of ``b.T`` in wide loads, int8 by ``dp4a``), and it may take
  float rows and quantize (and gate) each itself (``ops/grouped_dynamic.py``: QUANT, GATED);
  otherwise, and for block scales, [BLOCK_K, BLOCK_N] tiles of any strides;
- ``grouped_mm_kernel`` (many rows: prefill): the rows sorted by expert into blocks of
  ``BLOCK_M`` rows of one expert each (``grouped_launch.route``: padded with the sentinel row M,
  a block list of fixed length), a program a block and ``BLOCK_N`` columns; the rows are
  gathered as they load and scattered as they store, so nothing is copied around the launch.

int8 sums in int32 (exact), fp8 in fp32; the epilogue in fp32, one rounding. With block scales
(``BLOCK_SCALES``: fp8, one scale per 1x128 group of a row and per 128x128 block of an expert)
each BLOCK_K slice (which divides 128) is summed apart, scaled by its group's scales and added
to the fp32 accumulator, and the epilogue only adds and weighs. A row whose expert
id is outside [0, E) is stored as NaN: its block's expert is E (``route``), or the gemv program
sees it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv import gemv_cols, gemv_rows, row_scale
from .scaled_mm import mma


@triton.jit
def _epilogue(acc, rows, a_rows, cols, e, scale_a_ptr, scale_b_ptr, bias_ptr, w_ptr, stride_sbe, stride_biase, N,
              SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_ROW_WEIGHTS: tl.constexpr, BLOCK_SCALES: tl.constexpr, x_scale=1.0, QUANT: tl.constexpr = False):
    """acc [R, C] of routed rows ``rows`` (rows ``a_rows`` of ``a``) and columns ``cols`` (in
    range) of expert ``e``: fp32, scaled (unless ``BLOCK_SCALES``: already), biased and
    weighted, before the one rounding. QUANT: the row's scale is ``x_scale`` (the kernel's own)."""
    if BLOCK_SCALES:
        x = acc
    elif QUANT:
        sa = x_scale + tl.zeros(rows.shape, dtype=tl.float32)
    elif SCALE_A_PER_ROW:
        sa = tl.load(scale_a_ptr + a_rows).to(tl.float32)
    else:
        sa = tl.load(scale_a_ptr + a_rows * 0).to(tl.float32)
    if not BLOCK_SCALES:
        if SCALE_B_PER_CHANNEL:
            sb = tl.load(scale_b_ptr + e * stride_sbe + cols, mask=cols < N, other=0.0).to(tl.float32)
        else:
            sb = tl.load(scale_b_ptr + e * stride_sbe + cols * 0).to(tl.float32)
        x = acc.to(tl.float32) * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        x += tl.load(bias_ptr + e * stride_biase + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_ROW_WEIGHTS:
        x *= tl.load(w_ptr + rows).to(tl.float32)[:, None]
    return x


@triton.jit
def _block_scales(rows, cols, e, k0, scale_a_ptr, scale_b_ptr, stride_sam, stride_sag, stride_sbe, stride_sbg,
                  stride_sbn, N):
    """[R, C]: the scales of rows ``rows`` and columns ``cols`` for the 128-wide K group of ``k0``."""
    g = k0 // 128
    sa = tl.load(scale_a_ptr + rows * stride_sam + g * stride_sag)
    sb = tl.load(scale_b_ptr + e * stride_sbe + g * stride_sbg + (cols // 128) * stride_sbn, mask=cols < N, other=0.0)
    return sa[:, None] * sb[None, :]


@triton.jit
def grouped_gemv_kernel(
    a_ptr, b_ptr, out_ptr,  # (M, K); (E, K, N) any strides; (M, N) contiguous
    scale_a_ptr, scale_b_ptr, bias_ptr, w_ptr,  # (M,) or (1,); (E, N) or (E,); (E, N) or None; (M,) or None
    ids_ptr,  # (M,) the rows' experts
    g_ptr,  # GATED: the gates, with a's strides; else None
    M, N, K, E, A_SHARE,  # A_SHARE: routed rows a row of ``a`` (M / its rows)
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_sbe, stride_biase,
    stride_sam, stride_sag, stride_sbg, stride_sbn,  # block scales: scale_a (M, groups), scale_b (E, groups, blocks)
    SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ROW_WEIGHTS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CONTIG: tl.constexpr,  # b contiguous along K, not BLOCK_SCALES: gemv.py's main loop
    EVEN_K: tl.constexpr,  # K_CONTIG: K % BLOCK_K == 0
    DP4A: tl.constexpr,  # K_CONTIG: gemv_rows' DP4A (launch.dp4a_rows of each expert)
    # K_CONTIG: a is a float row quantized per token here (gemv.py's QUANT, its recipe), where
    # GATED the row silu(g) * a (scale_a_ptr unused)
    QUANT: tl.constexpr, DIVISOR: tl.constexpr, FLOOR: tl.constexpr, GATED: tl.constexpr, FLOOR_FIRST: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    a_row = m // A_SHARE
    e = tl.load(ids_ptr + m).to(tl.int64)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    # (the stores' columns from a helper that takes no pointer: Inductor's analysis of which
    # arguments a kernel writes counts every pointer passed to a helper whose result reaches a
    # store's address as written, and functionalization then copies those weights)
    cols, _ = gemv_cols(tl.program_id(1), N, BLOCK_N)
    x_scale = 1.0
    if K_CONTIG:
        row_ptr, gate_ptr = a_ptr + a_row * stride_am, g_ptr
        if GATED:
            gate_ptr = g_ptr + a_row * stride_am
        if QUANT:  # (each program reads the row twice more, from L2: its amax, then its blocks)
            x_scale = row_scale(row_ptr, gate_ptr, K, stride_ak, DIVISOR, FLOOR, BLOCK_K, EVEN_K, GATED, FLOOR_FIRST)
        acc = gemv_rows(tl.program_id(1), row_ptr, b_ptr + e * stride_be, N, K, stride_ak, stride_bn, BLOCK_N,
                        BLOCK_K, EVEN_K, x_scale, QUANT, gate_ptr, GATED, DP4A)
    else:
        acc = _rows_any_strides(a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, a_row, e, cols.to(tl.int64), N, K, stride_am,
                                stride_ak, stride_be, stride_bk, stride_bn, stride_sam, stride_sag, stride_sbe, stride_sbg,
                                stride_sbn, BLOCK_SCALES, BLOCK_N, BLOCK_K)
    rows = m + tl.zeros((1,), dtype=tl.int64)
    y = _epilogue(acc[None, :], rows, rows // A_SHARE, cols, e, scale_a_ptr, scale_b_ptr, bias_ptr, w_ptr, stride_sbe,
                  stride_biase, N, SCALE_A_PER_ROW, SCALE_B_PER_CHANNEL, HAS_BIAS, HAS_ROW_WEIGHTS, BLOCK_SCALES, x_scale,
                  QUANT)
    y = tl.where(valid, y, float("nan"))
    tl.store(out_ptr + m * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)


@triton.jit
def _rows_any_strides(a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, a_row, e, cols, N, K, stride_am, stride_ak, stride_be,
                      stride_bk, stride_bn, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbn,
                      BLOCK_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The row kernel's main loop for any strides of ``b`` and for block scales: acc (BLOCK_N,) of
    row ``a_row`` times expert ``e``'s [K, BLOCK_N] slice at columns ``cols``, read as
    [BLOCK_K, BLOCK_N] tiles; with BLOCK_SCALES each slice scaled as it is added (fp32)."""
    if a_ptr.dtype.element_ty == tl.int8:
        acc = tl.zeros((BLOCK_N,), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    b_cols = b_ptr + e * stride_be + cols[None, :] * stride_bn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a_ptr + a_row * stride_am + ks * stride_ak, mask=ks < K, other=0.0)
        w = tl.load(b_cols + ks[:, None] * stride_bk, mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        if a_ptr.dtype.element_ty == tl.int8:
            acc += tl.sum(x.to(tl.int32)[:, None] * w.to(tl.int32), axis=0)
        elif BLOCK_SCALES:
            s = _block_scales(a_row + tl.zeros((1,), dtype=tl.int64), cols, e, k0, scale_a_ptr, scale_b_ptr,
                              stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbn, N)
            acc += tl.sum(x.to(tl.float32)[:, None] * w.to(tl.float32), axis=0) * tl.reshape(s, (BLOCK_N,))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
    return acc


@triton.jit
def grouped_mm_kernel(
    a_ptr, b_ptr, out_ptr,  # as grouped_gemv_kernel's
    scale_a_ptr, scale_b_ptr, bias_ptr, w_ptr,
    rows_ptr,  # (BLOCKS * BLOCK_M,) the rows, sorted by expert, each expert's padded with M
    block_experts_ptr,  # (BLOCKS,) each block's expert: < E, E (rows with no valid expert: NaN), > E (none)
    M, N, K, E, A_SHARE,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_sbe, stride_biase,
    stride_sam, stride_sag, stride_sbg, stride_sbn,  # block scales: scale_a (M, groups), scale_b (E, groups, blocks)
    SCALE_A_PER_ROW: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ROW_WEIGHTS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    e = tl.load(block_experts_ptr + pid_b).to(tl.int64)
    if (e >= 0) & (e <= E):  # (a route the caller gave: nothing read or written out of bounds)
        rows = tl.load(rows_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        live = (rows >= 0) & (rows < M)
        rows = tl.where(live, rows, 0)  # (padding reads row 0; its store is masked off)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        out_mask = live[:, None] & (cols[None, :] < N)
        if e == E:
            nan = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], nan.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            if a_ptr.dtype.element_ty == tl.int8:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a_rows = rows // A_SHARE
            a_ptrs = a_ptr + a_rows[:, None] * stride_am
            b_cols = b_ptr + e * stride_be + cols[None, :] * stride_bn
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(a_ptrs + ks[None, :] * stride_ak, mask=ks[None, :] < K, other=0.0)
                w = tl.load(b_cols + ks[:, None] * stride_bk, mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
                if BLOCK_SCALES:
                    part = tl.dot(x, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), max_num_imprecise_acc=BLOCK_K)
                    acc += part * _block_scales(a_rows, cols, e, k0, scale_a_ptr, scale_b_ptr, stride_sam, stride_sag,
                                                stride_sbe, stride_sbg, stride_sbn, N)
                else:
                    acc = mma(x, w, acc, BLOCK_K)
            y = _epilogue(acc, rows, a_rows, cols, e, scale_a_ptr, scale_b_ptr, bias_ptr, w_ptr, stride_sbe, stride_biase, N,
                          SCALE_A_PER_ROW, SCALE_B_PER_CHANNEL, HAS_BIAS, HAS_ROW_WEIGHTS, BLOCK_SCALES)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _group(ids, offs, M, E, GROUPS: tl.constexpr):
    """Each row's group, given its id (loaded): its expert, E where its id is outside [0, E)
    (compared in the ids' own dtype: an int64 id is not wrapped), GROUPS - 1 from row M on (a
    group no block takes). (The route kernels load the ids themselves: a helper given a pointer
    would count as writing it, ``grouped_gemv_kernel``'s note.)"""
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    return tl.where(offs < M, key, GROUPS - 1)


@triton.jit
def route_count_kernel(
    ids_ptr,  # (M,) the rows' experts
    counts_ptr,  # (programs, GROUPS) out: each span's rows a group
    M, E, SPAN,
    GROUPS: tl.constexpr, CHUNK: tl.constexpr,
):
    """``route_kernel``'s first step where it runs in several programs: the group counts of each
    span of SPAN rows (a program a span)."""
    p = tl.program_id(0)
    end = tl.minimum(p * SPAN + SPAN, M)
    counts = tl.zeros((GROUPS,), dtype=tl.int32)
    for c0 in range(p * SPAN, end, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        counts += tl.histogram(_group(tl.load(ids_ptr + offs, mask=offs < end, other=0), offs, end, E, GROUPS), GROUPS)
    groups = tl.arange(0, GROUPS)
    tl.store(counts_ptr + p * GROUPS + groups, tl.where(groups <= E, counts, 0))


@triton.jit
def route_kernel(
    ids_ptr,  # (M,) the rows' experts
    counts_ptr,  # COUNTED: (PROGRAMS, GROUPS), route_count_kernel's; else None
    rows_ptr,  # (BLOCKS * BLOCK_M,) out: the rows sorted by expert, each expert's padded with M
    block_experts_ptr,  # (BLOCKS,) out: each block's expert (E: rows with no valid expert; E + 1: unused)
    M, E, BLOCKS, SPAN, PROGRAMS,  # a program a span of SPAN rows (one program: SPAN >= M)
    BLOCK_M: tl.constexpr,  # the sorted kernel's rows a block
    GROUPS: tl.constexpr,  # a power of two > E + 1: groups 0..E-1 the experts, E invalid ids, the rest unused
    GROUPS_LOG2: tl.constexpr,  # log2(GROUPS): the block experts' binary search takes GROUPS_LOG2 + 1 halvings
    CHUNK: tl.constexpr,
    COUNTED: tl.constexpr,  # PROGRAMS > 1: the spans' counts come from route_count_kernel
):
    """The sorted kernel's row order (``grouped_launch.route``'s contract): each expert's rows in
    their order, padded to whole blocks, the experts in order, then the rows whose id is outside
    [0, E). Each program places its span's rows: a row's place is its group's start, plus the
    group's rows in earlier spans (COUNTED: the counts' rows before this program's) and earlier
    in its span. The group sizes are the counts' sums (or, in one program, its own count).
    Padding slots, unused slots and the blocks' experts are spread over the programs; every slot
    is written once. ``ids`` contiguous."""
    p = tl.program_id(0)
    groups = tl.arange(0, GROUPS)
    if COUNTED:
        total = tl.zeros((GROUPS,), dtype=tl.int32)
        seen = tl.zeros((GROUPS,), dtype=tl.int32)  # the group's rows in earlier spans
        for q0 in range(0, PROGRAMS, CHUNK):
            spans = q0 + tl.arange(0, CHUNK)
            c = tl.load(counts_ptr + spans[:, None] * GROUPS + groups[None, :], mask=spans[:, None] < PROGRAMS, other=0)
            total += tl.sum(c, axis=0)
            seen += tl.sum(tl.where(spans[:, None] < p, c, 0), axis=0)
    else:
        total = tl.zeros((GROUPS,), dtype=tl.int32)
        for c0 in range(0, M, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            total += tl.histogram(_group(tl.load(ids_ptr + offs, mask=offs < M, other=0), offs, M, E, GROUPS), GROUPS)
        total = tl.where(groups <= E, total, 0)
        seen = tl.zeros((GROUPS,), dtype=tl.int32)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    before = tl.arange(0, CHUNK)[None, :] < tl.arange(0, CHUNK)[:, None]  # [i, j]: row j comes before row i
    end = tl.minimum(p * SPAN + SPAN, M)
    for c0 in range(p * SPAN, end, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        key = _group(tl.load(ids_ptr + offs, mask=offs < end, other=0), offs, end, E, GROUPS)
        rank = tl.sum(((key[None, :] == key[:, None]) & before).to(tl.int32), axis=1)
        tl.store(rows_ptr + tl.gather(pad_start + seen, key, 0) + rank, offs, mask=offs < end)
        seen += tl.histogram(key, GROUPS)
    if p == 0:  # each group's padding: the slots of its last block past its rows
        j = tl.arange(0, BLOCK_M)
        tl.store(rows_ptr + (pad_start + total)[:, None] + j[None, :], M, mask=j[None, :] < (padded - total)[:, None])
    slots = BLOCKS * BLOCK_M
    for s0 in range(tl.sum(padded, axis=0) + p * CHUNK, slots, PROGRAMS * CHUNK):  # the unused blocks' slots
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + offs, M, mask=offs < slots)
    # A block's expert: the number of groups ending at or before its first slot, found by a
    # binary search in ``ends`` (which rises), not by a compare with every group
    ends = tl.where(groups <= E, pad_end, 2147483647)
    for b0 in range(p * CHUNK, BLOCKS, PROGRAMS * CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        first = blocks * BLOCK_M
        lo = tl.zeros((CHUNK,), dtype=tl.int32)
        hi = tl.full((CHUNK,), GROUPS, dtype=tl.int32)
        for _ in tl.static_range(GROUPS_LOG2 + 1):
            mid = tl.minimum((lo + hi) // 2, GROUPS - 1)
            right = (lo < hi) & (tl.gather(ends, mid, 0) <= first)
            hi = tl.where((lo < hi) & ~right, mid, hi)
            lo = tl.where(right, mid + 1, lo)
        expert = lo
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < BLOCKS)
