"""The fused W8A8 GEMM: int8 (int32 accumulate) or fp8 e4m3 (fp32 accumulate), with the
whole dequantization epilogue in registers and one write of the output.

    out[m, n] = scale_a[m] * scale_b[n] * (acc[m, n] - azp[m] * azp_adj[n]) + bias[n]

Each epilogue variant (scale granularity, bias, zero point, or none: the raw int32
accumulator of ``fusepass.int_mm``) is a ``tl.constexpr`` flag, so every variant compiles
to straight-line code. Two more constexprs pick the main loop:

- ``USE_TMA``: ``a`` and ``b.T`` are read through TMA descriptors (Hopper's bulk tensor
  copies; K-contiguous operands with 16-byte aligned rows), which zero-fill past every edge.
  The descriptors are made on the device (``tl.make_tensor_descriptor``): host-side ones
  cannot be traced into Inductor's code, and Triton 3.6 re-encodes them on every launch
  (+40-130 us a call on the H100).
  Otherwise the tiles are pointer loads: row/column offsets are 64-bit, so M*K, K*N and M*N
  may pass 2**31 elements; ragged M and N wrap around (in-bounds loads, results masked at
  the store) and ragged K is masked with zeros.
- ``SPLIT_K``: at decode sizes a small weight gives too few (M, N) tiles to keep every SM
  reading; SPLIT_K > 1 programs each sum a slice of K and publish it in an int32/fp32
  partial buffer (``split_k_sum``). The last of a tile's programs to arrive (an atomic
  ticket) adds the slices in a fixed order, so the sum is the same on every run, and runs
  the epilogue: one launch, where a separate reduction kernel cost a second launch's host
  time on every call.

``launch`` (in ``launch.py``) chooses the configuration and launches the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile ``pid`` in grouped order: GROUP_M rows of tiles share B in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


# The integer zero-point terms int8 quantization gives at K <= 65535 (``ops/checks.py``'s
# MAX_K_INT8_AZP): a zero point |z| <= 128, a column sum of an int8 weight |colsum| <= 128 K
# < 2**23, a per-tensor term |z colsum| < 2**30. With them |acc - azp * azp_adj| < 2**31.
ZERO_POINT_MAX, COLSUM_MAX, PER_TENSOR_ADJ_MAX = 128, 2**23 - 1, 2**30 - 1
_ZP_MAX, _COLSUM_MAX, _ADJ_MAX = (tl.constexpr(v) for v in (ZERO_POINT_MAX, COLSUM_MAX, PER_TENSOR_ADJ_MAX))


@triton.jit
def epilogue(
    acc,  # (BLOCK_M, BLOCK_N) int32 or fp32
    offs_m, offs_n,  # (BLOCK_M,), (BLOCK_N,) int64, already wrapped into range
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP: tl.constexpr, RAW_ACC: tl.constexpr,
):
    # No early return: Triton still compiles the statements after one, None pointers included.
    if RAW_ACC:  # no scales: fusepass.int_mm's accumulator
        x = acc
    else:
        # Zero point first. int32 terms in the accumulator's int32, exact within the bounds int8
        # quantization keeps them in (ZERO_POINT_MAX ...: the sum then stays below 2**31); an
        # output whose terms are beyond them is NaN, never a wrapped-around value. An int64 term
        # makes the sum int64 (exact at any range, a wider tile); an fp32 one makes it fp32.
        refused = None
        if AZP == 1:  # per-tensor: azp_adj already holds z_a * colsum(b)
            adj = tl.load(azp_adj_ptr + offs_n)
            if adj.dtype == tl.int32:
                refused = ((adj > _ADJ_MAX) | (adj < -_ADJ_MAX))[None, :]
            acc = acc - adj[None, :]
        elif AZP == 2:  # per-token: azp[m] * colsum(b)[n]
            adj = tl.load(azp_adj_ptr + offs_n)
            azp = tl.load(azp_ptr + offs_m)
            if adj.dtype == tl.int32 and azp.dtype == tl.int32:
                refused = (((azp > _ZP_MAX) | (azp < -_ZP_MAX))[:, None]
                           | ((adj > _COLSUM_MAX) | (adj < -_COLSUM_MAX))[None, :])
            acc = acc - azp[:, None] * adj[None, :]
        if SCALE_A_PER_TOKEN:
            sa = tl.load(scale_a_ptr + offs_m).to(tl.float32)[:, None]
        else:
            sa = tl.load(scale_a_ptr).to(tl.float32)
        x = apply_scale_b(acc.to(tl.float32), sa, offs_n, scale_b_ptr, SCALE_B_PER_CHANNEL)
        if refused is not None:
            x = tl.where(refused, float("nan"), x)
    return add_bias(x, offs_n, bias_ptr, HAS_BIAS)


@triton.jit
def apply_scale_b(x, sa, offs_n, scale_b_ptr, SCALE_B_PER_CHANNEL: tl.constexpr):
    """``x`` (fp32) times ``sa * scale_b``: the scales' product first, the value's own scale
    (``acc * sa`` alone can pass fp32's range where the value does not; ``ops/reference.py``)."""
    if SCALE_B_PER_CHANNEL:
        return x * (sa * tl.load(scale_b_ptr + offs_n).to(tl.float32)[None, :])
    return x * (sa * tl.load(scale_b_ptr).to(tl.float32))


@triton.jit
def add_bias(x, offs_n, bias_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    return x


@triton.jit
def mma(a_tile, b_tile, acc, BLOCK_K: tl.constexpr):
    """``acc + a_tile @ b_tile``: int8 into int32, fp8 into fp32."""
    if a_tile.dtype == tl.int8:
        acc = tl.dot(a_tile, b_tile, acc, out_dtype=tl.int32)
    else:
        # Hopper's fp8 MMAs add at reduced precision; fold each BLOCK_K slice into the fp32
        # accumulator, as cuBLAS does without fast accumulation. At 4096^3 on H200: max
        # error 2.4e-5 of sum|a*b| (torch._scaled_mm: same) vs 5.4e-4 without.
        acc = tl.dot(a_tile, b_tile, acc, max_num_imprecise_acc=BLOCK_K)
    return acc


@triton.jit
def pointer_mainloop(
    acc,  # (BLOCK_M, BLOCK_N) int32 or fp32 zeros
    a_ptr, b_ptr,  # (M, K), (K, N)
    offs_m, offs_n,  # (BLOCK_M,), (BLOCK_N,) int64, wrapped into range
    k_first, k_end, K,  # the K blocks [k_first, k_end) of this program
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask
):
    """Sum K blocks [k_first, k_end) of a tile into ``acc`` through pointer loads; ragged K
    is masked with zeros."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # (BLOCK_K,)
    k0 = tl.cast(k_first, tl.int64) * BLOCK_K  # (k_first may be a literal 0)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    step_a = tl.cast(stride_ak, tl.int64) * BLOCK_K
    step_b = tl.cast(stride_bk, tl.int64) * BLOCK_K
    for kb in range(k_first, k_end):
        if EVEN_K:
            a_tile = tl.load(a_ptrs)
            b_tile = tl.load(b_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            # other=0.0: the interpreter needs a float fill for fp8 (cast to int8 for int8).
            a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_ptrs += step_a
        b_ptrs += step_b
        acc = mma(a_tile, b_tile, acc, BLOCK_K)
    return acc


@triton.jit
def k_slice(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[k_first, k_end): this program's run of whole K blocks, its split ``program_id(1)`` of
    SPLIT_K (empty for trailing splits of a short K)."""
    k_blocks = tl.cdiv(K, BLOCK_K)
    blocks_per_split = tl.cdiv(k_blocks, SPLIT_K)
    k_first = tl.program_id(1) * blocks_per_split
    return k_first, tl.minimum(k_first + blocks_per_split, k_blocks)


@triton.jit
def scaled_mm_kernel(
    # Operands
    a_ptr, b_ptr, out_ptr,  # (M, K), (K, N), (M, N)
    scale_a_ptr, scale_b_ptr,  # (M,) or (1,), (N,) or (1,); fp32, bf16 or fp16
    bias_ptr, azp_adj_ptr, azp_ptr,  # (N,), (N,), (M,); None when unused
    partial_ptr,  # (SPLIT_K, M, N) int32 or fp32 when SPLIT_K > 1; None otherwise
    tickets_ptr,  # (tiles,) int32 zeros when SPLIT_K > 1; None otherwise
    # Sizes
    M, N, K,
    # Strides (any layout of a and b without TMA)
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_om, stride_on,
    # Epilogue variant
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    AZP: tl.constexpr,  # 0: none, 1: per-tensor, 2: per-token
    RAW_ACC: tl.constexpr,  # no scales or zero point: store the accumulator
    # Tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K (grid axis 1)
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the pointer loads
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    k_first, k_end = k_slice(K, BLOCK_K, SPLIT_K)

    # 64-bit row/column indices; rows/columns past the edge wrap around to valid ones.
    offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # (BLOCK_M,)
    offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # (BLOCK_N,)
    in_dtype: tl.constexpr = a_ptr.dtype.element_ty
    if in_dtype == tl.int8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])  # (M, K)
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])  # b.T: (N, K)
        for kb in range(k_first, k_end):
            a_tile = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b_tile = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T  # (BLOCK_K, BLOCK_N)
            acc = mma(a_tile, b_tile, acc, BLOCK_K)
    else:
        acc = pointer_mainloop(acc, a_ptr, b_ptr, offs_m, offs_n, k_first, k_end, K,
                               stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, EVEN_K)

    # Store with unwrapped indices so the wrapped (duplicate) rows/columns are masked off.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    last = True
    if SPLIT_K > 1:
        last, acc = split_k_sum(acc, partial_ptr, tickets_ptr, rows, cols, mask, M, N, SPLIT_K)
    if last:
        x = epilogue(
            acc, offs_m, offs_n,
            scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
            SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP, RAW_ACC,
        )
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_k_sum(
    acc,  # (BLOCK_M, BLOCK_N) int32 or fp32: this program's slice of K
    partial_ptr,  # (SPLIT_K, M, N) of acc's dtype
    tickets_ptr,  # (tiles,) int32, zero before the launch; zero again after it
    rows, cols, mask,  # (BLOCK_M,), (BLOCK_N,) int64 unwrapped; (BLOCK_M, BLOCK_N) in bounds
    M, N,
    SPLIT_K: tl.constexpr,
):
    """Publish ``acc`` as this program's slice and take a ticket for its tile (grid axis 0).
    Returns ``(last, total)``: ``last`` is true in the one program that arrives last, where
    ``total`` is the sum of every slice in slice order (the same sum on every run, whichever
    program is last); elsewhere ``total`` is ``acc``."""
    tile = rows[:, None] * N + cols[None, :]  # (BLOCK_M, BLOCK_N)
    slice_size = tl.cast(M, tl.int64) * N  # 64-bit: SPLIT_K * M * N may pass 2**31
    tl.store(partial_ptr + tl.program_id(1) * slice_size + tile, acc, mask=mask)
    # Every thread's slice is stored before the ticket's release (one thread takes it).
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem="acq_rel")
    last = ticket == SPLIT_K - 1
    total = acc
    if last:
        # Hand the counter back zeroed: eager launches reuse one buffer (direct.split_scratch).
        tl.store(tickets_ptr + tl.program_id(0), 0)
        # .cg: read the other programs' slices from L2, past this SM's (incoherent) L1.
        total = tl.load(partial_ptr + tile, mask=mask, other=0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(partial_ptr + s * slice_size + tile, mask=mask, other=0, cache_modifier=".cg")
    return last, total
