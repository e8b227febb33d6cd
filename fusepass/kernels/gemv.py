"""The fused W8A8 product of one row of activations (M = 1: decode at batch 1), on CUDA
cores: the same epilogue as ``scaled_mm_kernel``'s, a different main loop.

    out[0, n] = scale_a * scale_b[n] * (sum_k a[0, k] * b[k, n] - azp * azp_adj[n]) + bias[n]

At M = 1 a tensor-core tile wastes 15 of its 16 rows, and the loads of ``b`` are what the
step waits for. Here each program reads ``BLOCK_N`` whole rows of ``b.T`` (``b``'s columns,
contiguous along K: ``w.t()`` of a row-major weight) ``BLOCK_K`` bytes at a time and
reduces them against the activation row in registers (int8 products summed exactly in int32;
fp8 ones, exact in fp32, summed in fp32). int8 rows whose blocks are whole words, starting on
word boundaries from a 16-byte one (``launch.dp4a_rows``), are read as int32 words and summed by PTX's ``dp4a``
(DP4A): one instruction for four products, where converting and multiplying each byte kept
the loop from the read's pace. Llama-3-8B's decode shapes read at 94% of the fastest one-launch
read of the same bytes on an H200 (docs/PERFORMANCE.md, "Why the code is as it is": "The M = 1 kernel").

K is not split: in one probe the four shapes took 68.7 us a layer unsplit and 80.5 in two slices
(``split_k_sum``'s partial buffer and ticket), and an op call then also needs its tickets
zeroed, a memset launch (84.9). Ragged N reads row 0 again (results masked at the store),
ragged K is masked with zeros. Rows of b.T and ``a``'s strided offsets are 64-bit; offsets
within a row 32-bit (K < 2**31).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scaled_mm import add_bias, apply_scale_b, epilogue


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """The fp32 ``x`` rounded to ``dtype`` (bf16, fp16 or fp32) to nearest even, held in fp32.
    On a GPU by its cast, one instruction. Under Triton's interpreter bf16 by its bits: the
    interpreter truncates an fp32 -> bf16 cast (measured, Triton 3.9), and the tests compare this
    rounding exactly against eager's. (A NaN is kept apart: 0x7FFFFFFF would round to -0.0.)"""
    if dtype == tl.bfloat16 and INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype).to(tl.float32)


# Under TRITON_INTERPRET=1 the kernels run as Python on the data (launch.INTERPRETED alike)
INTERPRETED: tl.constexpr = tl.constexpr(type(_rounded).__name__ == "InterpretedFunction")


@triton.jit
def _load(ptrs, in_k, EVEN_K: tl.constexpr):
    """``ptrs``' values; unless EVEN_K, zeros where not ``in_k``."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=in_k, other=0.0)


@triton.jit
def _row_block(
    a_ptr, g_ptr, offs_k, K, stride_ak,  # the row (1, K) and, where GATED, its gate (1, K): one stride
    EVEN_K: tl.constexpr, GATED: tl.constexpr,
):
    """The row's block at ``offs_k`` (zeros past K): in ``a``'s dtype; where GATED, in fp32,
    ``silu(g) * a`` computed as a ``transformers`` MLP's traced graph does it (``x / (1 + exp(-x))``
    in fp32, each op's result rounded to ``a``'s dtype as eager rounds it)."""
    offs = offs_k.to(tl.int64) * stride_ak
    x = _load(a_ptr + offs, offs_k < K, EVEN_K)
    if GATED:
        g = _load(g_ptr + offs, offs_k < K, EVEN_K).to(tl.float32)
        silu = _rounded(g / (1.0 + tl.exp(-g)), a_ptr.dtype.element_ty)
        x = _rounded(silu * x.to(tl.float32), a_ptr.dtype.element_ty)
    return x


@triton.jit
def row_scale(
    a_ptr, g_ptr, K, stride_ak,
    DIVISOR: tl.constexpr, FLOOR: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
    FLOOR_FIRST: tl.constexpr,
):
    """The per-token scale of the float row (``_row_block``'s) in fp32 with a correctly rounded
    division (``ops.dynamic.quantize_rows``'s recipes, ``DIVISOR`` and ``FLOOR``):
    ``max(amax / divisor, floor)``, or FLOOR_FIRST ``max(amax, floor) / divisor``. NaN where the row holds
    a NaN or an infinity, so every output is NaN, as eager's are for fp8 (torch's ``amax`` keeps
    a NaN, an infinite scale makes ``inf / inf``; a GPU's max drops NaN, and ``tl.clamp`` too)."""
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    nans = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        xf = _row_block(a_ptr, g_ptr, offs_k, K, stride_ak, EVEN_K, GATED).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xf))
        nans += xf * 0.0  # (NaN where xf is a NaN or an infinity, else 0: two instructions)
    return scale_of(tl.max(amax, axis=0), tl.sum(nans, axis=0), DIVISOR, FLOOR, FLOOR_FIRST)


@triton.jit
def scale_of(amax, nans, DIVISOR: tl.constexpr, FLOOR: tl.constexpr, FLOOR_FIRST: tl.constexpr):
    """``row_scale``'s recipe from a row's amax and the sum of its values times 0, NaN where it
    holds a NaN or an infinity (scalars, or a block of rows' alike)."""
    if FLOOR_FIRST:
        scale = tl.div_rn(tl.maximum(amax, FLOOR), DIVISOR)
    else:
        scale = tl.maximum(tl.div_rn(amax, DIVISOR), FLOOR)
    return tl.where(nans != nans, float("nan"), scale)


@triton.jit
def _e4m3(v):
    """The fp32 ``v`` (finite, |v| <= 448: clamped) rounded to nearest even on e4m3's grid, held
    in fp32 (exact there, so casting it is exact): 3 mantissa bits by its bits above 2**-6, steps
    of 2**-9 below (subnormals), by the 1.5 * 2**23 shift (which makes -0.0 +0.0: a sum cannot
    tell). By hand: Triton's interpreter rounds an fp32 -> e4m3 cast wrongly where it carries
    into the exponent (126.44 -> 64, Triton 3.9)."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = ((v * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantized(x, x_scale, FP8: tl.constexpr):
    """A block of the float row as int8 or (FP8) e4m3 values, held in fp32: ``x / x_scale``
    correctly rounded, clamped, then rounded to nearest even (int8: by the 1.5 * 2**23 shift,
    exact for |v| <= 128; e4m3: ``_e4m3``)."""
    if FP8:
        return _e4m3(tl.clamp(tl.div_rn(x.to(tl.float32), x_scale), -448.0, 448.0))
    v = tl.clamp(tl.div_rn(x.to(tl.float32), x_scale), -128.0, 127.0)
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _packed(x, BLOCK_K: tl.constexpr):
    """A block (BLOCK_K,) of int8 values (held in any integer or exact float dtype) as
    (BLOCK_K // 4,) int32 words of 4 bytes, the lowest first: ``x.view(torch.int32)``'s words."""
    bytes_ = tl.reshape(x.to(tl.int32) & 0xFF, (BLOCK_K // 4, 4))
    return tl.reduce(bytes_ << (tl.arange(0, 4) * 8)[None, :], 1, _or)


@triton.jit
def _dp4a(w, x, acc):
    """``acc`` plus the dot product of ``w``'s and ``x``'s 4 signed bytes, word by word: PTX's
    ``dp4a``, one instruction for 4 products (none in Triton's interpreter)."""
    return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, x, acc],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def gemv_cols(pid_n, N, BLOCK_N: tl.constexpr):
    """A program's BLOCK_N columns (rows of b.T): (cols, offs_n, with ragged ones read as column 0,
    masked at the store). It takes no pointer: a kernel stores to its result (``gemv_rows``' note)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    return cols, tl.where(cols < N, cols, 0).to(tl.int64)


@triton.jit
def gemv_rows(
    pid_n,  # this program's block of BLOCK_N rows of b.T
    a_ptr, b_ptr,  # (1, K), (K, N) with unit stride along K
    N, K, stride_ak, stride_bn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the loads
    x_scale,  # QUANT: the float row's scale (row_scale); else unused
    QUANT: tl.constexpr,  # a is a float row, quantized here to b's dtype (else of b's dtype)
    g_ptr, GATED: tl.constexpr,  # QUANT: the row is silu(g) * a (_row_block); else None, False
    DP4A: tl.constexpr = False,  # int8, EVEN_K, rows word-aligned (launch.dp4a_rows): words, dp4a
):
    """The main loop: acc (BLOCK_N,) of a @ b's columns ``gemv_cols(pid_n, N, BLOCK_N)``. Also
    ``group.py``'s, at M = 1, and ``grouped.py``'s row kernel's. The callers take the columns they
    store to from ``gemv_cols``, not from here: Inductor's analysis of a kernel counts every pointer
    argument of a helper whose result reaches a store's address as written (``a`` and ``b`` here;
    ``grouped_gemv_kernel``'s note)."""
    _, offs_n = gemv_cols(pid_n, N, BLOCK_N)
    row_starts = b_ptr + offs_n * stride_bn  # (BLOCK_N,): the rows of b.T
    is_int8: tl.constexpr = b_ptr.dtype.element_ty == tl.int8
    acc_dtype: tl.constexpr = tl.int32 if is_int8 else tl.float32
    if DP4A:
        words = row_starts.to(tl.pointer_type(tl.int32))  # (BLOCK_N,): the rows as 4-byte words
        acc4 = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    # The addresses are computed afresh each block, as offsets known to be contiguous and
    # BLOCK_K-aligned (16-byte vector loads where the rows' stride allows them).
    for kb in range(tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        if DP4A:
            offs_w = kb * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)  # (BLOCK_K // 4,)
            w = tl.load(words[:, None] + offs_w[None, :])  # (BLOCK_N, BLOCK_K // 4)
        elif EVEN_K:
            w = tl.load(row_starts[:, None] + offs_k[None, :])  # (BLOCK_N, BLOCK_K)
        else:
            # other=0.0: the interpreter needs a float fill for fp8 (cast to int8 for int8).
            w = tl.load(row_starts[:, None] + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
        x = _row_block(a_ptr, g_ptr, offs_k, K, stride_ak, EVEN_K, GATED)
        if QUANT:
            x = _quantized(x, x_scale, not is_int8)
        if DP4A:
            acc4 = _dp4a(w, tl.broadcast_to(_packed(x, BLOCK_K)[None, :], (BLOCK_N, BLOCK_K // 4)), acc4)
        else:
            acc += tl.sum(w.to(acc_dtype) * x.to(acc_dtype)[None, :], axis=1)
    if DP4A:
        acc = tl.sum(acc4, axis=1)
    return acc


@triton.jit
def scaled_gemv_kernel(
    # Operands
    a_ptr, b_ptr, out_ptr,  # (1, K), (K, N) with unit stride along K, (1, N)
    scale_a_ptr, scale_b_ptr,  # (1,) (None where QUANT), (N,) or (1,); fp32, bf16 or fp16
    bias_ptr, azp_adj_ptr, azp_ptr,  # (N,), (N,), (1,); None when unused
    g_ptr,  # (1, K) with a's strides: GATED's gate; else None
    # Sizes and strides
    N, K,
    stride_ak, stride_bn, stride_on,
    # Epilogue variant (as scaled_mm_kernel's)
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP: tl.constexpr, RAW_ACC: tl.constexpr,
    # Tiling
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the loads
    QUANT: tl.constexpr = False,  # a is a float row, quantized per token to b's dtype here
    # QUANT's recipe (row_scale); constexprs, so the other launches take no argument more
    # (the recipe's two values per model compile once)
    DIVISOR: tl.constexpr = 1.0, FLOOR: tl.constexpr = 0.0,
    GATED: tl.constexpr = False,  # QUANT's row is silu(g) * a (a Llama MLP's down_proj input)
    FLOOR_FIRST: tl.constexpr = False,  # QUANT's scale: max(amax, FLOOR) / DIVISOR (row_scale)
    DP4A: tl.constexpr = False,  # gemv_rows' DP4A
):
    x_scale = 1.0
    if QUANT:  # (each program reads the row twice more, from L2: its amax, then its blocks)
        x_scale = row_scale(a_ptr, g_ptr, K, stride_ak, DIVISOR, FLOOR, BLOCK_K, EVEN_K, GATED, FLOOR_FIRST)
    acc = gemv_rows(tl.program_id(0), a_ptr, b_ptr, N, K, stride_ak, stride_bn,
                    BLOCK_N, BLOCK_K, EVEN_K, x_scale, QUANT, g_ptr, GATED, DP4A)
    cols, offs_n = gemv_cols(tl.program_id(0), N, BLOCK_N)
    # As a (1, BLOCK_N) tile, so the epilogue is scaled_mm_kernel's.
    rows = tl.zeros((1,), dtype=tl.int64)
    if QUANT:  # the row's scale in a register, then the epilogue's other steps, in its order
        x = add_bias(apply_scale_b(acc[None, :].to(tl.float32), x_scale, offs_n, scale_b_ptr, SCALE_B_PER_CHANNEL),
                  offs_n, bias_ptr, HAS_BIAS)
    else:
        x = epilogue(
            acc[None, :], rows, offs_n,
            scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
            SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP, RAW_ACC,
        )
    tl.store(out_ptr + cols[None, :] * stride_on, x.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)


@triton.jit
def blockwise_gemv_kernel(
    # Operands
    a_ptr, b_ptr, out_ptr,  # (1, K) e4m3, (K, N) e4m3 with unit stride along K, (1, N)
    scale_a_ptr, scale_b_ptr,  # (1, ceil(K/128)), (ceil(K/128), ceil(N/128)); fp32
    bias_ptr,  # (N,); None when unused
    # Sizes and strides
    N, K,
    stride_ak, stride_bn, stride_on,
    stride_sag,  # scale_a: per K group
    stride_sbg, stride_sbn,  # scale_b: per K group, per N block
    HAS_BIAS: tl.constexpr,
    # Tiling: BLOCK_N divides 128 (a program's rows share their scales), BLOCK_K a multiple of 128
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the loads
    GROUP_K: tl.constexpr,  # 128
    QUANT: tl.constexpr = False,  # a is a float row, quantized here per group (scale_a_ptr None)
    FLOOR: tl.constexpr = 0.0,  # QUANT's recipe: a group's scale max(amax, FLOOR) / 448
):
    """The block-wise product (``blockwise.py``'s) of one row, on CUDA cores: ``gemv_rows``' reads
    (BLOCK_N rows of b.T, BLOCK_K bytes at a time), each block's products (exact in fp32) summed
    per 128-wide group in fp32, as the tile kernel's dots, scaled by the group's
    ``scale_a * scale_b`` and added to the fp32 accumulator; then the bias and the cast. No
    split K, so no partial buffer or ticket to zero before the launch.

    QUANT: ``a`` is the float row, and each block's groups are quantized where they are read
    (``ops/blockwise.py``'s ``scaled_mm_blockwise_dynamic``): a group's scale is its own amax
    (floored) / 448, so, unlike a per-token scale, it needs no read of the row beforehand. A
    group holding a NaN or an infinity gets a NaN scale (its outputs NaN, as eager's)."""
    pid_n = tl.program_id(0)
    cols, offs_n = gemv_cols(pid_n, N, BLOCK_N)
    row_starts = b_ptr + offs_n * stride_bn  # (BLOCK_N,)
    nb = (pid_n * BLOCK_N) // GROUP_K  # the N block of every row of this program
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    groups = tl.arange(0, GROUPS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        if EVEN_K:
            w = tl.load(row_starts[:, None] + offs_k[None, :])  # (BLOCK_N, BLOCK_K)
        else:
            # other=0.0: the interpreter needs a float fill for fp8.
            w = tl.load(row_starts[:, None] + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
        x = _load(a_ptr + offs_k.to(tl.int64) * stride_ak, offs_k < K, EVEN_K).to(tl.float32)
        g = kb * GROUPS + groups  # (GROUPS,): past the last group (ragged K) scaled by 0
        in_k = g * GROUP_K < K
        if QUANT:
            xg = tl.reshape(x, (GROUPS, GROUP_K))
            bad = tl.sum(((xg != xg) | (tl.abs(xg) == float("inf"))).to(tl.int32), axis=1) > 0
            sa = tl.div_rn(tl.maximum(tl.max(tl.abs(xg), axis=1), FLOOR), 448.0)  # (GROUPS,)
            sa = tl.where(bad, float("nan"), sa)
            x = tl.reshape(_e4m3(tl.clamp(tl.div_rn(xg, sa[:, None]), -448.0, 448.0)), (BLOCK_K,))
        else:
            sa = tl.load(scale_a_ptr + g * stride_sag, mask=in_k, other=0.0)
        prod = w.to(tl.float32) * x[None, :]  # (BLOCK_N, BLOCK_K), each product exact
        part = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, GROUP_K)), axis=2)  # (BLOCK_N, GROUPS)
        sb = tl.load(scale_b_ptr + g * stride_sbg + nb * stride_sbn, mask=in_k, other=0.0)
        acc += tl.sum(part * (sa * sb)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)
    tl.store(out_ptr + cols * stride_on, acc.to(out_ptr.dtype.element_ty), mask=cols < N)
