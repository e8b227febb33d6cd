"""The op ``fusepass::scaled_grouped_mm``: a mixture of experts' quantized matmul, each row of
the activation multiplied by the weight of the expert it is routed to::

    e = expert_ids[m]
    out[m, :] = (scale_a[m] * scale_b[e, :] * (a[m, :] @ b[e]) + bias[e, :]) * row_weights[m]

int8 sums exact in int32, fp8 ones in fp32; the epilogue in fp32, rounded once to ``out_dtype``.
A row whose expert id is outside [0, E) is NaN (the op cannot raise there without reading the
ids back to the host, which a CUDA graph forbids; a NaN row is never silently a number).

Arguments:

- ``a``: [M, K] int8 or float8_e4m3fn, the quantized rows in any order (a top-k router's
  token-expert pairs: M = tokens * k; M may be 0); or [T, K] with M a multiple of T, routed row
  m reading ``a[m // (M / T)]`` (each token's row once for its k consecutive routed rows: no
  gather of k copies before the launch); ``scale_a`` then per row of ``a``;
- ``b``: [E, K, N] of ``a``'s dtype, any strides (usually ``w.transpose(1, 2)`` of the experts'
  stored [E, N, K] weights);
- ``scale_a``: fp32 (or bf16 / fp16, widened exactly), one value or one per row ([M] / [M, 1]);
- ``scale_b``: fp32 (or bf16 / fp16), per expert and channel [E, N], or one per expert [E] / [E, 1];
- or, for fp8 with DeepSeek-V3's blocks (transformers' native FP8 experts), fp32 ``scale_a``
  [M, ceil(K/128)] (one per 1x128 group of a row) and ``scale_b`` [E, ceil(K/128), ceil(N/128)]
  (one per 128x128 block of each expert, any strides: the stored [E, N/128, K/128]'s transpose),
  each group's product scaled as it is summed (``scaled_mm_blockwise``'s recipe);
- ``expert_ids``: [M] int32 or int64, each row's expert;
- ``out_dtype``: bfloat16, float16 or float32;
- ``bias``: None or [E, N] of an output dtype;
- ``row_weights``: None or [M] (or [M, 1]) of a float dtype: each row's factor in the epilogue,
  a router's weight, so that the down projection's output is already weighted;
- ``sorted_rows``, ``block_experts``: None, or ``route_experts(expert_ids, E, block_m)``'s two
  tensors for these ids: a layer's gate/up and down sort their rows once (``policy.grouped_block_m``
  gives the block size the launch takes; a route of another block size is not used). On CUDA
  they are taken as they are (checking them would cost a launch); the CPU checks them against
  the reference's.

``fusepass::route_experts(expert_ids, num_experts, block_m)``: the sorted blocks' row order
(``kernels.grouped_launch.route``; on CPU ``reference.route_experts``): [sorted_rows, block_experts],
int32, the rows sorted by expert (stable; ids outside [0, E) last, as one group), each group
padded with the row M to whole blocks of ``block_m`` rows, in a list of a length fixed by M, E
and ``block_m`` (``route_blocks``); each block's expert (E: the invalid ids' group; E + 1: unused).

Why ids per row rather than ``torch._grouped_mm``'s offsets: at decode (batch 1, top-8: 8 rows
in 8 experts) rows need no sorting, histogram or gather before the launch, and each program
reads only its row's expert's weight; the launch sorts them itself where rows are many enough
to share weight tiles (``kernels/grouped_launch.py``), without a host sync.

On CUDA: the Triton kernels of ``fusepass.kernels.grouped``; on CPU: the reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.blockwise import BLOCK
from ..kernels.grouped_launch import launch_route, launch_scaled_grouped_mm, route_blocks
from ..kernels.launch import traced
from . import reference
from .checks import (
    BIAS_DTYPES, INPUT_DTYPES, MAX_K_INT8, SCALE_DTYPES, check_devices, check_gpu, check_k, check_operands,
    check_out_dtype, check_tensor, describe, is_vector_of,
)
from .registry import call, define

Tensor = torch.Tensor
OP = "fusepass.scaled_grouped_mm"
ID_DTYPES = (torch.int32, torch.int64)


def _check_scales(scale_a, scale_b, M, N, E) -> None:
    """Per-row (or one) activation scales; per expert and channel (or one per expert) weight scales."""
    check_tensor(OP, "scale_a", scale_a, SCALE_DTYPES)
    if not ((scale_a.numel() == 1 and scale_a.dim() <= 2) or is_vector_of(scale_a, M, 0)):
        raise ValueError(f"{OP}: `scale_a` must hold one value or one per row of `a` (M = {M}): numel 1, "
                         f"or shape [{M}] or [{M}, 1]; got {describe(scale_a)}")
    check_expert_scales(OP, scale_b, N, E)


def check_expert_scales(op: str, scale_b, N, E) -> None:
    """Weight scales per expert and channel, or one per expert."""
    check_tensor(op, "scale_b", scale_b, SCALE_DTYPES)
    if tuple(scale_b.shape) not in ((E, N), (E,), (E, 1)):
        raise ValueError(f"{op}: `scale_b` must be per expert and channel [E, N] = [{E}, {N}], or one per "
                         f"expert [{E}] or [{E}, 1]; got {describe(scale_b)}")


def _check_block_scales(a, scale_a, scale_b, M, K, N, E) -> None:
    """fp8 with DeepSeek-V3's blocks: ``scale_a`` [M, ceil(K/128)], ``scale_b`` [E, ceil(K/128), ceil(N/128)], fp32."""
    groups, blocks = -(-K // BLOCK), -(-N // BLOCK)
    if a.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{OP}: 128x128 block scales (a 3-D `scale_b`) are for float8_e4m3fn operands; got `a` of "
                         f"{a.dtype}")
    for name, t, shape in (("scale_a", scale_a, (M, groups)), ("scale_b", scale_b, (E, groups, blocks))):
        check_tensor(OP, name, t, (torch.float32,))
        if tuple(t.shape) != shape:
            what = "one per 1x128 group of a row" if name == "scale_a" else "one per 128x128 block of each expert"
            raise ValueError(f"{OP}: with block scales `{name}` must be {list(shape)} ({what}, K = {K}, N = {N}); "
                             f"got {describe(t)}")


def check_grouped_args(a, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights, sorted_rows=None,
                       block_experts=None) -> None:
    """Validate the arguments (module docstring); errors name the argument."""
    T, K, N = check_operands(OP, a, b, INPUT_DTYPES, experts=True)
    E = b.shape[0]
    check_out_dtype(OP, out_dtype)
    M = check_expert_ids(OP, expert_ids, T, "a")
    if scale_b.dim() == 3:
        _check_block_scales(a, scale_a, scale_b, T, K, N, E)
    else:
        _check_scales(scale_a, scale_b, T, N, E)
    tensors = {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "expert_ids": expert_ids}
    check_route(OP, sorted_rows, block_experts, M, E, tensors)
    check_routed_rest(OP, tensors, bias, row_weights, M, K, N, E)


def check_route(op: str, sorted_rows, block_experts, M, E, tensors: dict) -> None:
    """Neither, or both int32 of ``route_experts``' sizes at M rows and E experts (added to
    ``tensors``, whose device they must share)."""
    if sorted_rows is None and block_experts is None:
        return
    if sorted_rows is None or block_experts is None:
        raise ValueError(f"{op}: `sorted_rows` and `block_experts` come together (route_experts' two tensors); got "
                         f"only `{'block_experts' if sorted_rows is None else 'sorted_rows'}`")
    for name, t in (("sorted_rows", sorted_rows), ("block_experts", block_experts)):
        check_tensor(op, name, t, (torch.int32,))
        tensors[name] = t
    blocks = block_experts.shape[0] if block_experts.dim() == 1 else 0
    block_m = sorted_rows.shape[0] // blocks if sorted_rows.dim() == 1 and blocks else 0
    if not block_m or sorted_rows.shape[0] != blocks * block_m or blocks != route_blocks(M, E, block_m):
        raise ValueError(f"{op}: `sorted_rows` and `block_experts` must be route_experts(expert_ids, {E}, block_m)'s "
                         f"at M = {M} rows: [blocks * block_m] and [blocks], blocks = (M + (E + 1) * (block_m - 1) "
                         f"+ block_m - 1) // block_m; got sorted_rows {describe(sorted_rows)}, block_experts "
                         f"{describe(block_experts)}")


def check_expert_ids(op: str, expert_ids, T, rows: str) -> int:
    """[M] int ids, one a row of ``rows`` (T of them) or a whole number for each; returns M."""
    check_tensor(op, "expert_ids", expert_ids, ID_DTYPES)
    M = expert_ids.shape[0] if expert_ids.dim() == 1 else None
    if M is None or not (M == T or (T > 0 and M % T == 0)):
        raise ValueError(f"{op}: `expert_ids` must be [M]: one expert a row of `{rows}` (M = {T}), or a whole number "
                         f"of experts for each (M a multiple of {T}: a top-k router's k rows a token); got "
                         f"{describe(expert_ids)}")
    return M


def check_routed_rest(op: str, tensors: dict, bias, row_weights, M, K, N, E) -> None:
    """The bias and row weights, one device for all, K's int8 bound, a GPU that runs the dtype."""
    b = tensors["b"]
    if bias is not None:
        check_tensor(op, "bias", bias, BIAS_DTYPES)
        if tuple(bias.shape) != (E, N):
            raise ValueError(f"{op}: `bias` must be [E, N] = [{E}, {N}] (one an expert); got {describe(bias)}")
        tensors["bias"] = bias
    if row_weights is not None:
        check_tensor(op, "row_weights", row_weights, SCALE_DTYPES)
        if not is_vector_of(row_weights, M, 0):
            raise ValueError(f"{op}: `row_weights` must be [M] or [M, 1] with M = {M}; got {describe(row_weights)}")
        tensors["row_weights"] = row_weights
    check_devices(op, tensors)
    if b.dtype == torch.int8:
        check_k(op, K, MAX_K_INT8)
    check_gpu(op, b.device, b.dtype)


def checked_route(op: str, sorted_rows, block_experts, expert_ids, E):
    """(sorted_rows, block_experts) as the launch takes them (None where not given); on CPU and not
    traced, refused unless they are the reference's route of ``expert_ids`` (on CUDA a check would
    cost a launch and a sync)."""
    if sorted_rows is None:
        return None
    if expert_ids.device.type == "cpu" and not traced(expert_ids):
        want = reference.route_experts(expert_ids, E, sorted_rows.shape[0] // block_experts.shape[0])
        if not (torch.equal(sorted_rows, want[0]) and torch.equal(block_experts, want[1])):
            raise ValueError(f"{op}: `sorted_rows` and `block_experts` are not route_experts(expert_ids, {E}, "
                             "block_m)'s of these `expert_ids`")
    return sorted_rows, block_experts


def scaled_grouped_mm_impl(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    expert_ids: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    row_weights: Optional[Tensor] = None,
    sorted_rows: Optional[Tensor] = None,
    block_experts: Optional[Tensor] = None,
) -> Tensor:
    check_grouped_args(a, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights, sorted_rows, block_experts)
    routed = checked_route(OP, sorted_rows, block_experts, expert_ids, b.shape[0])
    if a.device.type == "cuda":
        return launch_scaled_grouped_mm(a, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights,
                                        routed=routed)
    return reference.scaled_grouped_mm(a, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights)


def scaled_grouped_mm_fake(a, b, scale_a, scale_b, expert_ids, out_dtype, bias=None, row_weights=None, sorted_rows=None,
                           block_experts=None):
    check_grouped_args(a, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights, sorted_rows, block_experts)
    return a.new_empty((expert_ids.shape[0], b.shape[2]), dtype=out_dtype)


define("scaled_grouped_mm", scaled_grouped_mm_impl, scaled_grouped_mm_fake)


def scaled_grouped_mm(a, b, scale_a, scale_b, expert_ids, out_dtype, bias=None, row_weights=None,
                      sorted_rows=None, block_experts=None) -> Tensor:
    """Each row ``a[m]`` times its expert's weight ``b[expert_ids[m]]``, scaled, biased and
    weighted in one fused kernel (module docstring). Returns a new contiguous [M, N] tensor of
    ``out_dtype``. Same as ``torch.ops.fusepass.scaled_grouped_mm``."""
    return call("scaled_grouped_mm", scaled_grouped_mm_impl,
                (a, b, scale_a, scale_b, expert_ids, out_dtype, bias, row_weights, sorted_rows, block_experts),
                out_dtype, replay=False)


ROUTE_OP = "fusepass.route_experts"


def check_route_args(expert_ids, num_experts, block_m) -> None:
    """Validate ``route_experts``' arguments (module docstring); errors name the argument."""
    check_tensor(ROUTE_OP, "expert_ids", expert_ids, ID_DTYPES)
    if expert_ids.dim() != 1:
        raise ValueError(f"{ROUTE_OP}: `expert_ids` must be [M]; got {describe(expert_ids)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{ROUTE_OP}: `num_experts` must be an int >= 1; got {num_experts!r}")
    if not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"{ROUTE_OP}: `block_m` must be a power of two (the sorted blocks' rows); got {block_m!r}")


def route_experts_impl(expert_ids: Tensor, num_experts: int, block_m: int) -> list[Tensor]:
    check_route_args(expert_ids, num_experts, block_m)
    if expert_ids.device.type == "cuda":
        return list(launch_route(expert_ids, num_experts, block_m))
    return list(reference.route_experts(expert_ids, num_experts, block_m))


def route_experts_fake(expert_ids, num_experts, block_m):
    check_route_args(expert_ids, num_experts, block_m)
    blocks = route_blocks(expert_ids.shape[0], num_experts, block_m)
    return [expert_ids.new_empty((blocks * block_m,), dtype=torch.int32),
            expert_ids.new_empty((blocks,), dtype=torch.int32)]


define("route_experts", route_experts_impl, route_experts_fake)


def route_experts(expert_ids, num_experts, block_m) -> list[Tensor]:
    """The sorted blocks' row order for ``expert_ids`` (module docstring): [sorted_rows,
    block_experts], for the layer's grouped matmuls. Same as ``torch.ops.fusepass.route_experts``."""
    return call("route_experts", route_experts_impl, (expert_ids, num_experts, block_m), replay=False)
