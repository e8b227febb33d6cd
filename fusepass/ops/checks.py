"""Input validation shared by the fake, CPU and CUDA implementations of every op.

Each check raises before any kernel runs, with a message that names the argument and
says what was expected and what was given. Dtype problems raise ``TypeError``; shape,
device and size problems raise ``ValueError``.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.blockwise import BLOCK

INPUT_DTYPES = (torch.int8, torch.float8_e4m3fn)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = OUT_DTYPES
AZP_DTYPES = (torch.int32, torch.int64, torch.float32)
# Per-tensor / per-token / per-channel scales: fp32, or bf16 / fp16 (widened to fp32 in the
# kernel, exactly). torchao 0.17's int8 weights carry bf16 scales: a cast to fp32 in the graph
# was one more kernel per linear per step (25 of a 4-layer decode step's 101).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# int8 products are at most 128 * 128 = 2**14 in magnitude, so an int32 sum of K of them
# is exact for K <= (2**31 - 1) // 2**14.
MAX_K_INT8 = (2**31 - 1) // (128 * 128)
# With a zero point the corrected sum acc - azp * azp_adj is taken in int32: |acc| < 2**30 at
# K <= 65535, and int32 terms within what int8 quantization gives there (the kernels'
# zero-point bounds) keep it below 2**31, exact; terms beyond them give NaN outputs (int64
# terms: an int64 sum, exact).
MAX_K_INT8_AZP = (2**30 - 1) // (128 * 128)

# The kernels use Ampere's int8 tensor cores (and bf16); fp8 e4m3 needs Ada (sm_89) or Hopper.
MIN_CAPABILITY = (8, 0)
MIN_FP8_CAPABILITY = (8, 9)


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(op: str, name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: `{name}` must have dtype {names(dtypes)}; got {describe(t)}")


def is_vector_of(t: torch.Tensor, length, axis: int) -> bool:
    """True for [length] or, with axis 0 / 1, the 2-D [length, 1] / [1, length]."""
    if t.dim() == 1:
        return t.shape[0] == length
    if t.dim() == 2:
        shape = (length, 1) if axis == 0 else (1, length)
        return tuple(t.shape) == shape
    return False


def check_scale(op: str, name: str, t, length, axis: int) -> None:
    check_tensor(op, name, t, SCALE_DTYPES)
    per_tensor = t.numel() == 1 and t.dim() <= 2
    if not (per_tensor or is_vector_of(t, length, axis)):
        shapes = f"[{length}, 1] or [{length}]" if axis == 0 else f"[1, {length}] or [{length}]"
        what = f"row of `a` (M = {length})" if axis == 0 else f"column of `b` (N = {length})"
        raise ValueError(
            f"{op}: `{name}` must hold one value (per-tensor) or one per {what}: "
            f"numel 1, or shape {shapes}; got {describe(t)}"
        )


@functools.lru_cache(maxsize=None)  # on every CUDA call: ask the driver once per device
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def gpu_too_old(device: torch.device, dtype: torch.dtype) -> tuple | None:
    """(the capability ``dtype``'s kernels need, the device's) where ``device`` is a GPU older
    than that, else None (also for fake CUDA tensors on a host without a GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    need = MIN_CAPABILITY if dtype == torch.int8 else MIN_FP8_CAPABILITY
    return (need, cap) if cap < need else None


def check_gpu(op: str, device: torch.device, dtype: torch.dtype) -> None:
    """The GPU must have the tensor cores the kernel uses; say so instead of failing in Triton."""
    old = gpu_too_old(device, dtype)
    if old is not None:
        (need, cap), what = old, "int8 inputs" if dtype == torch.int8 else "float8_e4m3fn inputs"
        raise ValueError(
            f"{op}: {what} need a GPU with compute capability >= {need[0]}.{need[1]}; "
            f"{device} has {cap[0]}.{cap[1]}"
        )


def check_out_dtype(op: str, out_dtype) -> None:
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in OUT_DTYPES:
        what = "" if isinstance(out_dtype, torch.dtype) else f" ({type(out_dtype).__name__}, not a torch.dtype)"
        raise TypeError(f"{op}: `out_dtype` must be one of {names(OUT_DTYPES)}; got {out_dtype!r}{what}")


def check_operands(op: str, a, b, in_dtypes, experts: bool = False) -> tuple:
    """``a`` [M, K] and ``b`` [K, N] (``experts``: [E, K, N], one weight an expert) of one supported
    dtype; returns (M, K, N)."""
    check_tensor(op, "a", a, in_dtypes)
    check_tensor(op, "b", b, in_dtypes)
    if b.dtype != a.dtype:
        raise TypeError(f"{op}: `b` must have the dtype of `a` ({a.dtype}); got {describe(b)}")
    if a.dim() != 2:
        raise ValueError(f"{op}: `a` must be 2-D [M, K]; got {describe(a)}")
    shape = "[E, K, N]" if experts else "[K, N]"
    if b.dim() != 2 + experts:
        raise ValueError(f"{op}: `b` must be {2 + experts}-D {shape}" + (" (one [K, N] weight an expert)" if experts else "")
                         + f"; got {describe(b)}")
    M, K = a.shape
    if b.shape[-2] != K:
        raise ValueError(
            f"{op}: `b` must be {shape} with K = {K} (from `a` {tuple(a.shape)}); "
            f"got b of shape {tuple(b.shape)}"
        )
    return M, K, b.shape[-1]


def check_devices(op: str, tensors: dict) -> None:
    """Every tensor on the device of the first (the op's activation, named so in the error)."""
    first, ref = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(
                f"{op}: all tensors must be on one device; `{first}` is on {ref.device} "
                f"but `{name}` is on {t.device}"
            )


def check_k(op: str, K, max_k: int) -> None:
    if K > max_k:
        raise ValueError(
            f"{op}: K = {K} is too large for exact int32 accumulation of int8 products "
            f"(at most {max_k}); split K and add the partial results"
        )


def check_bias(op: str, bias, N, tensors: dict) -> None:
    """``bias`` is None or [N] of an output dtype; adds it to ``tensors`` (for the device check)."""
    if bias is None:
        return
    check_tensor(op, "bias", bias, BIAS_DTYPES)
    if bias.dim() != 1 or bias.shape[0] != N:
        raise ValueError(f"{op}: `bias` must be [N] with N = {N}; got {describe(bias)}")
    tensors["bias"] = bias


def check_int_mm_args(op: str, a, b) -> None:
    """Validate the arguments of ``int_mm``."""
    _, K, _ = check_operands(op, a, b, (torch.int8,))
    check_devices(op, {"a": a, "b": b})
    check_k(op, K, MAX_K_INT8)
    check_gpu(op, a.device, a.dtype)


def check_scaled_mm_args(
    op: str,
    a,
    b,
    scale_a,
    scale_b,
    out_dtype,
    bias,
    azp_adj=None,
    azp=None,
    *,
    with_azp: bool = False,
) -> None:
    """Validate the arguments of ``scaled_mm`` (``with_azp=False``) or ``scaled_mm_azp``."""
    M, K, N = check_operands(op, a, b, (torch.int8,) if with_azp else INPUT_DTYPES)
    check_out_dtype(op, out_dtype)
    check_scale(op, "scale_a", scale_a, M, 0)
    check_scale(op, "scale_b", scale_b, N, 1)
    tensors = {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b}
    check_bias(op, bias, N, tensors)
    if with_azp:
        check_tensor(op, "azp_adj", azp_adj, AZP_DTYPES)
        if not is_vector_of(azp_adj, N, 1):
            raise ValueError(
                f"{op}: `azp_adj` must be [N] or [1, N] with N = {N}; got {describe(azp_adj)}"
            )
        tensors["azp_adj"] = azp_adj
        if azp is not None:
            check_tensor(op, "azp", azp, AZP_DTYPES)
            if not is_vector_of(azp, M, 0):
                raise ValueError(
                    f"{op}: `azp` (per-token zero point) must be [M] or [M, 1] with M = {M}; "
                    f"got {describe(azp)}"
                )
            tensors["azp"] = azp
    check_devices(op, tensors)
    if a.dtype == torch.int8:
        check_k(op, K, MAX_K_INT8_AZP if with_azp else MAX_K_INT8)
    check_gpu(op, a.device, a.dtype)


# --- block-wise scales (fusepass.scaled_mm_blockwise) -------------------------------------



def _ceil_div(n, d):
    return (n + d - 1) // d


def blocks(n):
    """How many 128-wide groups cover ``n`` (the last one ragged); works on SymInts."""
    return _ceil_div(n, BLOCK)


def _check_block_scale_a(op: str, t, M, K) -> None:
    check_tensor(op, "scale_a", t, (torch.float32,))
    kb = blocks(K)
    if t.dim() == 2 and t.shape[0] == M and t.shape[1] == kb:
        return
    hint = ""
    if t.dim() == 2 and t.shape[0] == kb and t.shape[1] == M:
        hint = "; that is [ceil(K/128), M]: pass its transpose `scale_a.t()` (an M-major view, as cuBLAS takes it)"
    elif t.dim() == 2 and t.shape[0] == M and t.shape[1] == 1:
        hint = "; one scale per row is per-token scaling: use fusepass.scaled_mm"
    elif t.dim() == 2 and t.shape[0] == M and t.shape[1] > 0:
        hint = f"; {t.shape[1]} groups over K = {K} would be {_ceil_div(K, t.shape[1])}-wide, not 128"
    raise ValueError(
        f"{op}: `scale_a` must be [M, ceil(K/128)] = [{M}, {kb}], one scale per row of `a` and 128-wide "
        f"group of K (K = {K}); got {describe(t)}{hint}"
    )


def _check_block_scale_b(op: str, t, K, N) -> None:
    check_tensor(op, "scale_b", t, (torch.float32,))
    kb, nb = blocks(K), blocks(N)
    if t.dim() == 2 and t.shape[0] == kb and t.shape[1] == nb:
        return
    hint = ""
    if t.dim() == 2 and t.shape[0] == nb and t.shape[1] == kb:
        hint = ("; that is [ceil(N/128), ceil(K/128)], the layout of an [N, K] weight's scales: pass its "
                "transpose, as `b` is the weight's (`scale_b=w_scale.t()`)")
    elif t.dim() == 2 and t.shape[0] == (kb + 3) // 4 * 4 and t.shape[1] == nb:
        hint = f"; cuBLAS's layout pads the K blocks to a multiple of 4: pass `scale_b[:{kb}]`"
    elif t.dim() == 2 and t.shape[0] == kb and t.shape[1] == N:
        hint = "; one scale per column of `b` (1x128 weight groups) is not supported: the op takes 128x128 blocks"
    elif t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0:
        hint = (f"; {t.shape[0]}x{t.shape[1]} blocks over [K, N] = [{K}, {N}] would be "
                f"{_ceil_div(K, t.shape[0])}x{_ceil_div(N, t.shape[1])}, not 128x128")
    raise ValueError(
        f"{op}: `scale_b` must be [ceil(K/128), ceil(N/128)] = [{kb}, {nb}], one scale per 128x128 block of "
        f"`b` [K, N] = [{K}, {N}]; got {describe(t)}{hint}"
    )


def check_blockwise_dynamic_args(op: str, x, b, scale_b, out_dtype, bias, floor) -> None:
    """Validate the arguments of ``scaled_mm_blockwise_dynamic``: ``x`` a float [M, K] with K
    whole 128-wide groups, the rest as ``scaled_mm_blockwise``'s, ``floor`` > 0."""
    check_tensor(op, "x", x, (torch.bfloat16, torch.float16, torch.float32))
    check_tensor(op, "b", b, (torch.float8_e4m3fn,))
    if x.dim() != 2 or b.dim() != 2 or b.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: `x` must be [M, K] and `b` [K, N]; got x {describe(x)}, b {describe(b)}")
    K, N = b.shape
    if K % BLOCK:
        raise ValueError(f"{op}: K must be whole 128-wide groups (the activation's scales are per group); got K = {K}")
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < float("inf"):
        raise ValueError(f"{op}: `floor` must be a finite number > 0 (a group of zeros would divide 0 by 0); got "
                         f"{floor!r}")
    check_out_dtype(op, out_dtype)
    _check_block_scale_b(op, scale_b, K, N)
    tensors = {"x": x, "b": b, "scale_b": scale_b}
    check_bias(op, bias, N, tensors)
    check_devices(op, tensors)
    check_gpu(op, x.device, b.dtype)


def check_scaled_mm_blockwise_args(op: str, a, b, scale_a, scale_b, out_dtype, bias) -> None:
    """Validate the arguments of ``scaled_mm_blockwise`` (float8_e4m3fn only)."""
    M, K, N = check_operands(op, a, b, (torch.float8_e4m3fn,))
    check_out_dtype(op, out_dtype)
    _check_block_scale_a(op, scale_a, M, K)
    _check_block_scale_b(op, scale_b, K, N)
    tensors = {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b}
    check_bias(op, bias, N, tensors)
    check_devices(op, tensors)
    check_gpu(op, a.device, a.dtype)


DYNAMIC = "fusepass.scaled_mm_dynamic"
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def valid_recipe(divisor, floor) -> bool:
    """The op's ``divisor`` and ``floor``: numbers (not bools), ``divisor`` > 0, ``floor`` >= 0."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (divisor, floor))
    return numbers and divisor > 0 and floor >= 0


def check_dynamic_args(x, b, scale_b, out_dtype, bias, divisor, floor, gate=None, floor_first=None) -> None:
    """``fusepass.scaled_mm_dynamic``'s arguments (``ops/dynamic.py``). Validate the arguments (``scaled_mm``'s checks, ``x`` in place of ``a`` and ``scale_a``)."""
    check_tensor(DYNAMIC, "x", x, X_DTYPES)
    if gate is not None:
        check_tensor(DYNAMIC, "gate", gate, X_DTYPES)
        if gate.dtype != x.dtype or gate.shape != x.shape:
            raise ValueError(f"{DYNAMIC}: `gate` must have `x`'s dtype and shape; got gate {describe(gate)}, "
                             f"x {describe(x)}")
    check_tensor(DYNAMIC, "b", b, INPUT_DTYPES)
    if x.dim() != 2 or b.dim() != 2 or b.shape[0] != x.shape[1]:
        raise ValueError(f"{DYNAMIC}: `x` must be [M, K] and `b` [K, N]; got x {describe(x)}, b {describe(b)}")
    check_out_dtype(DYNAMIC, out_dtype)
    if not valid_recipe(divisor, floor):
        raise ValueError(f"{DYNAMIC}: `divisor` must be > 0 and `floor` >= 0; got {divisor!r}, {floor!r}")
    if not (floor_first is None or isinstance(floor_first, bool)):
        raise ValueError(f"{DYNAMIC}: `floor_first` must be None, True or False; got {floor_first!r}")
    K, N = b.shape
    check_scale(DYNAMIC, "scale_b", scale_b, N, 1)
    tensors = {"x": x, "b": b, "scale_b": scale_b}
    if gate is not None:
        tensors["gate"] = gate
    check_bias(DYNAMIC, bias, N, tensors)
    check_devices(DYNAMIC, tensors)
    if b.dtype == torch.int8:
        check_k(DYNAMIC, K, MAX_K_INT8)
    check_gpu(DYNAMIC, x.device, b.dtype)
