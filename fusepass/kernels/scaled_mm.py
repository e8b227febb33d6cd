"""The fused W8A8 GEMM: int8 (int32 accumulate) or fp8 e4m3 (fp32 accumulate), with the
whole dequantization epilogue in registers and one write of the output.

    out[m, n] = scale_a[m] * scale_b[n] * (acc[m, n] - azp[m] * azp_adj[n]) + bias[n]

Each epilogue variant (scale granularity, bias, zero point) is a ``tl.constexpr`` flag,
so every variant compiles to straight-line code. Row/column offsets are 64-bit, so
M*K, K*N and M*N may pass 2**31 elements. Ragged M and N wrap around (their loads are
in bounds and their results are masked at the store); ragged K is masked with zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import select_config


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
    # Pointers
    a_ptr, b_ptr, out_ptr,  # (M, K), (K, N), (M, N)
    scale_a_ptr, scale_b_ptr,  # (M,) or (1,), (N,) or (1,); fp32
    bias_ptr, azp_adj_ptr, azp_ptr,  # (N,), (N,), (M,); any pointer when unused
    # Sizes
    M, N, K,
    # Strides (any layout of a and b)
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
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the K loop
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

    # 64-bit row/column indices; rows/columns past the edge wrap around to valid ones.
    offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # (BLOCK_M,)
    offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # (BLOCK_K,)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    step_a = tl.cast(stride_ak, tl.int64) * BLOCK_K
    step_b = tl.cast(stride_bk, tl.int64) * BLOCK_K

    if a_ptr.dtype.element_ty == tl.int8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            # other=0.0: the interpreter needs a float fill for fp8 (cast to int8 for int8).
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if a_ptr.dtype.element_ty == tl.int8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            # Hopper's fp8 MMAs add at reduced precision; fold each BLOCK_K slice into the
            # fp32 accumulator, as cuBLAS does without fast accumulation. At 4096^3 on H200:
            # max error 2.4e-5 of sum|a*b| (torch._scaled_mm: same) vs 5.4e-4 without.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += step_a
        b_ptrs += step_b

    x = _epilogue(
        acc, offs_m, offs_n,
        scale_a_ptr, scale_b_ptr, bias_ptr, azp_adj_ptr, azp_ptr,
        SCALE_A_PER_TOKEN, SCALE_B_PER_CHANNEL, HAS_BIAS, AZP,
    )

    # Store with unwrapped indices so the wrapped (duplicate) rows/columns are masked off.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptrs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A vector argument as a contiguous 1-D tensor (a view in the usual case)."""
    return None if t is None else t.reshape(-1).contiguous()


def launch_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    azp_adj: torch.Tensor | None = None,
    azp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the fused kernel on validated inputs (K >= 1) and return a new (M, N) tensor.

    ``azp_adj`` alone selects the per-tensor zero point, ``azp_adj`` and ``azp`` the
    per-token one. Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1.
    """
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    scale_a, scale_b = _flat(scale_a), _flat(scale_b)
    bias, azp_adj, azp = _flat(bias), _flat(azp_adj), _flat(azp)
    cfg = select_config(M, N, K)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    scaled_mm_kernel[grid](
        a, b, out,
        scale_a, scale_b,
        bias if bias is not None else scale_b,
        azp_adj if azp_adj is not None else scale_b,
        azp if azp is not None else scale_a,
        M, N, K,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1),
        SCALE_A_PER_TOKEN=scale_a.numel() > 1,
        SCALE_B_PER_CHANNEL=scale_b.numel() > 1,
        HAS_BIAS=bias is not None,
        AZP=0 if azp_adj is None else (1 if azp is None else 2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=K % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
