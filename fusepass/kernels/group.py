"""The fused W8A8 GEMM for up to four weights that share one quantized activation, in one
launch: q/k/v projections at decode sizes.

    out_i[m, n] = scale_a[m] * scale_b_i[n] * (a @ b_i)[m, n] + bias_i[n]    (i < MEMBERS)

The grid covers every member's (M, N_i) tiles, member after member; a program finds its
member and runs ``scaled_mm_kernel``'s pointer main loop and epilogue on that member's
operands. Each member is its own branch (``_member_tile`` inlined per member, all operands
plain arguments), so no program selects a pointer at run time.

Why: a default-mode compiled decode step is host-bound, and each launch costs host time
(a Llama layer's q, k and v are three launches; here one). It also fills the GPU where a
small weight alone would not (k_proj's N = 1024 gives 16 tiles of 64 columns).

Decode sizes only: pointer loads (``POINTER_LOADS_MAX_M``), the joined weight's split of K
where the launch may split (``scaled_mm.split_k_sum``: each member's tiles take tickets of
their own, and its slices a slab of the partial buffer), and the epilogue variants the
members share (scale granularity, bias); no zero point. At M = 1 with the weights as stored
(``b = w.t()``, columns contiguous along K) each program reduces rows of a member's b.T
instead, ``gemv.py``'s loop (``GEMV``): the members then run as their joined weight would.
``group_launch.py`` chooses the config and launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv import gemv_cols, gemv_rows
from .scaled_mm import epilogue, k_slice, pointer_mainloop, split_k_sum


@triton.jit
def _member_tile(
    pid_m, pid_n,  # this program's tile of the member's (M, N_i) output
    a_ptr, b_ptr, out_ptr,  # (M, K), (K, N_i), (M, N_i) contiguous
    scale_a_ptr, scale_b_ptr, bias_ptr,  # (M,) or (1,), (N_i,) or (1,), (N_i,) or None
    partial_ptr, tickets_ptr,  # SPLIT_K > 1: all members' (SPLIT_K, M, N_i) slabs; a ticket a tile
    col0,  # the members' columns before this one's: where its slab starts, in (SPLIT_K, M) rows
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    GEMV: tl.constexpr,  # M = 1, b's columns contiguous along K: gemv.py's main loop
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # not GEMV: programs along K (grid axis 1)
    DP4A: tl.constexpr,  # GEMV: gemv_rows' DP4A
):
    if GEMV:  # (BLOCK_N rows of b.T; BLOCK_M is 1)
        acc = gemv_rows(pid_n, a_ptr, b_ptr, N, K, stride_ak, stride_bn, BLOCK_N, BLOCK_K, EVEN_K,
                        1.0, False, None, False, DP4A)
        cols, offs_n = gemv_cols(pid_n, N, BLOCK_N)
        rows = tl.zeros((1,), dtype=tl.int64)
        x = epilogue(acc[None, :], rows, offs_n, scale_a_ptr, scale_b_ptr, bias_ptr, None, None,
                      SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, 0, False)
        tl.store(out_ptr + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)
    else:
        # Rows/columns past the edge wrap around to valid ones; the store masks them off.
        offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # (BLOCK_M,)
        offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # (BLOCK_N,)
        if a_ptr.dtype.element_ty == tl.int8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_first, k_end = k_slice(K, BLOCK_K, SPLIT_K)
        acc = pointer_mainloop(acc, a_ptr, b_ptr, offs_m, offs_n, k_first, k_end, K,
                               stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, EVEN_K)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        last = True
        if SPLIT_K > 1:
            slab = partial_ptr + tl.cast(M, tl.int64) * col0 * SPLIT_K
            last, acc = split_k_sum(acc, slab, tickets_ptr, rows, cols, mask, M, N, SPLIT_K)
        if last:
            x = epilogue(acc, offs_m, offs_n, scale_a_ptr, scale_b_ptr, bias_ptr, None, None,
                          SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, 0, False)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scaled_mm_group_kernel(
    # Shared operands
    a_ptr, scale_a_ptr,  # (M, K); (M,) or (1,) fp32, bf16 or fp16
    # Members: weights (K, N_i) of one layout, new contiguous outputs (M, N_i), their
    # scales (N_i,) or (1,) and biases (N_i,); members past MEMBERS are None
    b0_ptr, b1_ptr, b2_ptr, b3_ptr,
    out0_ptr, out1_ptr, out2_ptr, out3_ptr,
    scale_b0_ptr, scale_b1_ptr, scale_b2_ptr, scale_b3_ptr,
    bias0_ptr, bias1_ptr, bias2_ptr, bias3_ptr,
    # Split K: (SPLIT_K, M, N_i) slabs, member after member, and one zeroed int32 ticket a
    # tile (grid axis 0); None unsplit
    partial_ptr, tickets_ptr,
    # Sizes
    M, K,
    N0, N1, N2, N3,
    # Strides (every member's b has the same)
    stride_am, stride_ak,
    stride_bk, stride_bn,
    # Epilogue variant, the same for every member
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    # Tiling
    MEMBERS: tl.constexpr,  # 2..4
    GEMV: tl.constexpr,  # M = 1 with b's columns contiguous along K: rows of b.T (gemv.py)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # not GEMV: programs along K (grid axis 1)
    DP4A: tl.constexpr = False,  # GEMV, int8, EVEN_K, every member's rows word-aligned (launch.dp4a_rows)
):
    # Tile t of the members' column tiles, laid end to end; M's tiles of one column tile
    # are neighbours, so they read that slice of the weight while it is in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % tiles_m
    t = tl.program_id(0) // tiles_m
    end0 = tl.cdiv(N0, BLOCK_N)
    end1 = end0 + tl.cdiv(N1, BLOCK_N)
    end2 = end1 + tl.cdiv(N2, BLOCK_N)
    if t < end0:
        _member_tile(pid_m, t, a_ptr, b0_ptr, out0_ptr, scale_a_ptr, scale_b0_ptr, bias0_ptr,
                     partial_ptr, tickets_ptr, 0,
                     M, N0, K, stride_am, stride_ak, stride_bk, stride_bn,
                     SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, GEMV, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_K, DP4A)
    elif t < end1:
        _member_tile(pid_m, t - end0, a_ptr, b1_ptr, out1_ptr, scale_a_ptr, scale_b1_ptr, bias1_ptr,
                     partial_ptr, tickets_ptr, N0,
                     M, N1, K, stride_am, stride_ak, stride_bk, stride_bn,
                     SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, GEMV, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_K, DP4A)
    elif MEMBERS >= 3:
        if t < end2:
            _member_tile(pid_m, t - end1, a_ptr, b2_ptr, out2_ptr, scale_a_ptr, scale_b2_ptr, bias2_ptr,
                         partial_ptr, tickets_ptr, N0 + N1,
                         M, N2, K, stride_am, stride_ak, stride_bk, stride_bn,
                         SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, GEMV, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_K, DP4A)
        elif MEMBERS >= 4:
            _member_tile(pid_m, t - end2, a_ptr, b3_ptr, out3_ptr, scale_a_ptr, scale_b3_ptr, bias3_ptr,
                         partial_ptr, tickets_ptr, N0 + N1 + N2,
                         M, N3, K, stride_am, stride_ak, stride_bk, stride_bn,
                         SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, GEMV, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT_K, DP4A)
