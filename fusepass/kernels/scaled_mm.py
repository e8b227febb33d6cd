"""The fused W8A8 GEMM: int8 (int32 accumulate) or fp8 e4m3 (fp32 accumulate), with the
whole dequantization epilogue in registers and one write of the output.

    out[m, n] = scale_a[m] * scale_b[n] * (acc[m, n] - azp[m] * azp_adj[n]) + bias[n]

Each epilogue variant (scale granularity, bias, zero point) is a ``tl.constexpr`` flag,
so every variant compiles to straight-line code. Two more constexprs pick the main loop:

- ``USE_TMA``: ``a`` and ``b.T`` arrive as TMA descriptors (Hopper's bulk tensor copies;
  needs K-contiguous operands with 16-byte aligned rows), which zero-fill past every edge.
  Otherwise the tiles are pointer loads: row/column offsets are 64-bit, so M*K, K*N and M*N
  may pass 2**31 elements; ragged M and N wrap around (in-bounds loads, results masked at
  the store) and ragged K is masked with zeros.
- ``SPLIT_K``: at decode sizes a small weight gives too few (M, N) tiles to keep every SM
  reading; SPLIT_K > 1 programs each sum a slice of K into an int32/fp32 partial buffer,
  and ``splitk_epilogue_kernel`` adds the slices in a fixed order (deterministic) and runs
  the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import Config, pointer_loads, select_config


@triton.jit
def _epilogue(
    acc,  # (BLOCK_M, BLOCK_N) int32 or fp32
    offs_m, offs_n,  # (BLOCK_M,), (BLOCK_N,) int64, already wrapped into range
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP: tl.constexpr,
):
    # Zero point first, in the accumulator's integer domain when azp/azp_adj are int32
    # (exact, as in vLLM's CUTLASS epilogue); fp32 operands promote it to fp32.
    if AZP == 1:  # per-tensor: azp_adj already holds z_a * colsum(b)
        adj = tl.load(azp_adj_ptr + offs_n)
        acc = acc - adj[None, :]
    elif AZP == 2:  # per-token: azp[m] * colsum(b)[n]
        adj = tl.load(azp_adj_ptr + offs_n)
        azp = tl.load(azp_ptr + offs_m)
        acc = acc - azp[:, None] * adj[None, :]
    x = acc.to(tl.float32)
    if SCALE_A_PER_TOKEN:
        x = x * tl.load(scale_a_ptr + offs_m)[:, None]
    else:
        x = x * tl.load(scale_a_ptr)
    if SCALE_B_PER_CHANNEL:
        x = x * tl.load(scale_b_ptr + offs_n)[None, :]
    else:
        x = x * tl.load(scale_b_ptr)
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    return x


@triton.jit
def scaled_mm_kernel(
    # Operands: pointers, or with USE_TMA descriptors of a (M, K) and of b.T (N, K)
    a, b, out_ptr,  # (M, K), (K, N), (M, N)
    scale_a_ptr, scale_b_ptr,  # (M,) or (1,), (N,) or (1,); fp32
    bias_ptr, azp_adj_ptr, azp_ptr,  # (N,), (N,), (M,); any pointer when unused
    partial_ptr,  # (SPLIT_K, M, N) int32 or fp32 when SPLIT_K > 1; any pointer otherwise
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
    # Tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K (grid axis 1)
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the pointer loads
):
    # Grouped ordering of the tiles, so that GROUP_M rows of tiles share B in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # This program's slice of K, in whole blocks (empty for trailing splits of a short K).
    k_blocks = tl.cdiv(K, BLOCK_K)
    blocks_per_split = tl.cdiv(k_blocks, SPLIT_K)
    k_first = tl.program_id(1) * blocks_per_split
    k_end = tl.minimum(k_first + blocks_per_split, k_blocks)

    # 64-bit row/column indices; rows/columns past the edge wrap around to valid ones.
    offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # (BLOCK_M,)
    offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # (BLOCK_K,)
    if not USE_TMA:
        k0 = k_first.to(tl.int64) * BLOCK_K
        a_ptrs = a + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
        b_ptrs = b + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
        step_a = tl.cast(stride_ak, tl.int64) * BLOCK_K
        step_b = tl.cast(stride_bk, tl.int64) * BLOCK_K

    if USE_TMA:
        in_dtype: tl.constexpr = a.dtype
    else:
        in_dtype: tl.constexpr = a.dtype.element_ty
    if in_dtype == tl.int8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(k_first, k_end):
        if USE_TMA:
            a_tile = a.load([pid_m * BLOCK_M, kb * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b_tile = b.load([pid_n * BLOCK_N, kb * BLOCK_K]).T  # (BLOCK_K, BLOCK_N)
        else:
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
        if in_dtype == tl.int8:
            acc = tl.dot(a_tile, b_tile, acc, out_dtype=tl.int32)
        else:
            # Hopper's fp8 MMAs add at reduced precision; fold each BLOCK_K slice into the
            # fp32 accumulator, as cuBLAS does without fast accumulation. At 4096^3 on H200:
            # max error 2.4e-5 of sum|a*b| (torch._scaled_mm: same) vs 5.4e-4 without.
            acc = tl.dot(a_tile, b_tile, acc, max_num_imprecise_acc=BLOCK_K)

    # Store with unwrapped indices so the wrapped (duplicate) rows/columns are masked off.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        x = _epilogue(
            acc, offs_m, offs_n,
            scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
            SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP,
        )
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, x.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        slice_ptr = partial_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(slice_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def splitk_epilogue_kernel(
    partial_ptr,  # (SPLIT_K, M, N) int32 or fp32
    out_ptr,  # (M, N)
    scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
    M, N,
    stride_om, stride_on,
    SCALE_A_PER_TOKEN: tl.constexpr, SCALE_B_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, AZP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_m = rows % M
    offs_n = cols % N
    ptrs = partial_ptr + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.load(ptrs)
    for s in tl.static_range(1, SPLIT_K):  # fixed order: the same sum on every run
        acc += tl.load(ptrs + s * M * N)
    x = _epilogue(
        acc, offs_m, offs_n,
        scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
        SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP,
    )
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             x.to(out_ptr.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A vector argument as a contiguous 1-D tensor (a view in the usual case)."""
    return None if t is None else t.reshape(-1).contiguous()


def _tma_operands(a: torch.Tensor, b: torch.Tensor, cfg: Config):
    """TMA descriptors of a (M, K) and b.T (N, K), or None when the layout does not allow
    them: TMA needs unit stride along K and 16-byte aligned bases and row strides."""
    if a.stride(1) != 1 or b.stride(0) != 1:
        return None
    if any(v % 16 for v in (a.data_ptr(), b.data_ptr(), a.stride(0), b.stride(1))):
        return None
    (M, K), N = a.shape, b.shape[1]
    return (
        TensorDescriptor(a, [M, K], [a.stride(0), 1], [cfg.block_m, cfg.block_k]),
        TensorDescriptor(b, [N, K], [b.stride(1), 1], [cfg.block_n, cfg.block_k]),
    )


def _table_config(M: int, N: int, K: int, a: torch.Tensor, azp: bool) -> Config:
    """The tuned config, without TMA where the launch is host-bound: Triton 3.6 encodes host
    descriptors on every launch (H100, M=16, outside CUDA graphs: 117 us per call with them
    vs 77 us without, at N=K=256; 176 vs 46 us at N=K=4096). Under graph capture that is paid
    once, and at M > 64 the kernel outlasts it; elsewhere the same tiles load through pointers
    (bit-identical results)."""
    cfg = select_config(M, N, K, a.dtype, a.device, azp=azp)
    if cfg.tma and M <= 64 and a.is_cuda and not torch.cuda.is_current_stream_capturing():
        return pointer_loads(cfg)
    return cfg


def launch_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    azp_adj: torch.Tensor | None = None,
    azp: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """Run the fused kernel on validated inputs (K >= 1) and return a new (M, N) tensor.

    ``azp_adj`` alone selects the per-tensor zero point, ``azp_adj`` and ``azp`` the
    per-token one. ``config`` overrides the tuned launch configuration (tests, tuning).
    Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1.
    """
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    scale_a, scale_b = _flat(scale_a), _flat(scale_b)
    bias, azp_adj, azp = _flat(bias), _flat(azp_adj), _flat(azp)
    cfg = config or _table_config(M, N, K, a, azp_adj is not None)
    tma = _tma_operands(a, b, cfg) if cfg.tma else None
    epilogue = dict(
        SCALE_A_PER_TOKEN=scale_a.numel() > 1,
        SCALE_B_PER_CHANNEL=scale_b.numel() > 1,
        HAS_BIAS=bias is not None,
        AZP=0 if azp_adj is None else (1 if azp is None else 2),
    )
    vectors = (
        scale_a, scale_b,
        bias if bias is not None else scale_b,
        azp_adj if azp_adj is not None else scale_b,
        azp if azp is not None else scale_a,
    )
    partial = out
    if cfg.split_k > 1:
        acc_dtype = torch.int32 if a.dtype == torch.int8 else torch.float32
        partial = torch.empty((cfg.split_k, M, N), dtype=acc_dtype, device=a.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), cfg.split_k)
    scaled_mm_kernel[grid](
        *(tma or (a, b)), out,
        *vectors,
        partial,
        M, N, K,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1),
        **epilogue,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SPLIT_K=cfg.split_k,
        USE_TMA=tma is not None,
        EVEN_K=K % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block_m, block_n = min(16, triton.next_power_of_2(M)), 128
        splitk_epilogue_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
            partial, out,
            *vectors,
            M, N,
            out.stride(0), out.stride(1),
            **epilogue,
            SPLIT_K=cfg.split_k,
            BLOCK_M=block_m, BLOCK_N=block_n,
        )
    return out
