"""The fused W8A8 GEMM as a persistent kernel, for large M on Hopper.

Same math and epilogue flags as ``scaled_mm_kernel`` (``scaled_mm.py``); what differs is how
the tiles are walked and written:

- one program per SM (``NUM_SMS``) takes output tiles ``tile_id, tile_id + NUM_SMS, ...`` in
  grouped order (Triton's tutorial 09), so no tile waits for a program to be scheduled and
  the last wave is no emptier than a launch of one program per tile leaves it;
- ``a`` and ``b.T`` are read through TMA descriptors made on the device, and the output is
  written through one (``tl.make_tensor_descriptor``), which clips rows and columns past the
  edge;
- the epilogue runs on the accumulator in two halves along N (epilogue subtiling): each half's
  fp32 values and store buffer take half the registers and shared memory, which leaves room
  for 4 stages of 256x128 tiles with a 2-byte output (whole-tile stores: out of shared
  memory; an fp32 output gets 3, ``launch.persistent_stages``).

A probe against the op's tuned one-program-per-tile configs, int8, H200, bench_linear's
protocol: the best persistent config 1.02-1.10x faster
at M >= 4096, 0.99-1.01x at M = 1024. The tuned table (``Config.persistent``) says where it
runs; ``launch`` falls back to ``scaled_mm_kernel`` where TMA cannot read the operands or
write the output, or 2 stages do not fit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scaled_mm import epilogue, grouped_tile, mma


@triton.jit
def _store_half(
    acc,  # (BLOCK_M, HALF_N) int32 or fp32: one half of a tile's accumulator
    out_desc, row0, col0,  # the (M, N) output's descriptor; the half's first row and column
    offs_m, N,  # (BLOCK_M,) int64 rows, wrapped into range
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP: tl.constexpr, RAW_ACC: tl.constexpr,
    HALF_N: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    offs_n = (col0.to(tl.int64) + tl.arange(0, HALF_N)) % N  # (HALF_N,), wrapped into range
    x = epilogue(
        acc, offs_m, offs_n,
        scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
        SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP, RAW_ACC,
    )
    out_desc.store([row0, col0], x.to(OUT_DTYPE))


@triton.jit
def scaled_mm_persistent_kernel(
    # Operands
    a_ptr, b_ptr, out_ptr,  # (M, K) K-contiguous, (K, N) N-strided (b.T K-contiguous), (M, N) row-major
    scale_a_ptr, scale_b_ptr,  # (M,) or (1,), (N,) or (1,); fp32, bf16 or fp16
    bias_ptr, azp_adj_ptr, azp_ptr,  # (N,), (N,), (M,); None when unused
    # Sizes
    M, N, K,
    # Row strides (TMA: unit stride along K for a and b.T, along N for out)
    stride_am, stride_bn, stride_om,
    # Epilogue variant and tiling, as scaled_mm_kernel's
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    AZP: tl.constexpr, RAW_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,  # programs in the grid, each striding over the tiles
):
    HALF_N: tl.constexpr = BLOCK_N // 2
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])  # (M, K)
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])  # b.T: (N, K)
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_om, 1],
                                         block_shape=[BLOCK_M, HALF_N])  # (M, N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    in_dtype: tl.constexpr = a_ptr.dtype.element_ty
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if in_dtype == tl.int8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_blocks):
            a_tile = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b_tile = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T  # (BLOCK_K, BLOCK_N)
            acc = mma(a_tile, b_tile, acc, BLOCK_K)

        offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # (BLOCK_M,)
        # (BLOCK_M, BLOCK_N) -> two (BLOCK_M, HALF_N): the left and right halves of the tile
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
        row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        _store_half(left, out_desc, row0, col0, offs_m, N,
                    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
                    SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP, RAW_ACC, HALF_N, out_dtype)
        _store_half(right, out_desc, row0, col0 + HALF_N, offs_m, N,
                    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
                    SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP, RAW_ACC, HALF_N, out_dtype)
