"""The op ``fusepass::scaled_mm_group``: ``fusepass::scaled_mm`` of one activation with 2 to
4 weights, in one kernel launch. With ``a``, ``scale_a`` and ``out_dtype`` shared::

    out[i] = scaled_mm(a, b[i], scale_a, scale_b[i], out_dtype, bias[i])    for each i

as a list of new contiguous [M, N_i] tensors: int8 exactly (exact int32 sums, the same
epilogue); fp8 up to the order of its fp32 sums (the group's BLOCK_K and split of K, its
members' joined weight's, where a lone ``scaled_mm`` may take others).

Arguments: ``a``, ``scale_a`` and ``out_dtype`` as for ``scaled_mm`` (int8 or float8_e4m3fn;
no zero point); ``b``: 2 to 4 weights [K, N_i] of ``a``'s dtype, any strides; ``scale_b``:
one per weight, per-tensor or per-channel [N_i] / [1, N_i]; ``bias``: one entry per weight,
each [N_i] or None. Each member is checked as ``scaled_mm`` checks its arguments, and the
errors name the member.

It is what the pass makes of sibling matmuls at decode sizes (``fusepass.passes.group``:
a Llama layer's q/k/v, or gate and up), where each launch costs host time. On CUDA the
members run in one launch of ``fusepass.kernels.group`` when they share a weight layout
(strides) and an epilogue variant (scale granularities, bias or none) and M is static;
otherwise each runs as its own ``scaled_mm`` launch (same results). On CPU: the reference.

Why a sibling op rather than grouping inside ``scaled_mm``: one call has to see every
member's operands to launch once, and the list arguments and outputs are another schema.
Like the others it is a ``torch.library.triton_op``, lowered by ``fusepass.passes.lower``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from ..kernels.group_launch import launch_scaled_mm_group
from ..kernels.policy import MAX_MEMBERS, launch_variant
from .checks import check_out_dtype, check_scaled_mm_args
from .registry import call, define, launch_graphs
from .scaled_mm import compute

Tensor = torch.Tensor
OP = "fusepass.scaled_mm_group"


def _check_lists(b, scale_b, bias) -> None:
    for name, seq in (("b", b), ("scale_b", scale_b), ("bias", bias)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{OP}: `{name}` must be a list (one entry per weight); got {type(seq).__name__}")


def check_group_args(a, b, scale_a, scale_b, out_dtype, bias) -> None:
    """2..4 members, one scale_b and one bias entry each, each a valid ``scaled_mm``."""
    _check_lists(b, scale_b, bias)
    check_out_dtype(OP, out_dtype)
    if not 2 <= len(b) <= MAX_MEMBERS:
        raise ValueError(f"{OP}: `b` must hold 2 to {MAX_MEMBERS} weights; got {len(b)}"
                         + (" (one weight: fusepass.scaled_mm)" if len(b) == 1 else ""))
    if len(scale_b) != len(b) or len(bias) != len(b):
        raise ValueError(f"{OP}: `scale_b` and `bias` need one entry per weight ({len(b)}); "
                         f"got {len(scale_b)} and {len(bias)}")
    for i, (bi, si, biasi) in enumerate(zip(b, scale_b, bias)):
        check_scaled_mm_args(f"{OP} (weight {i})", a, bi, scale_a, si, out_dtype, biasi)


def one_launch(a, b, scale_b, bias) -> bool:
    """Whether the members can run as one grouped launch: static sizes, and one
    ``launch_variant`` (weight layout, scale granularity, bias or none) for all."""
    if not all(is_concrete_int(s) for t in (a, *b) for s in t.shape):
        return False
    variants = {launch_variant(*member) for member in zip(b, scale_b, bias)}
    return len(variants) == 1 and None not in variants


def scaled_mm_group_impl(
    a: Tensor,
    b: list[Tensor],
    scale_a: Tensor,
    scale_b: list[Tensor],
    out_dtype: torch.dtype,
    bias: list[Optional[Tensor]],
) -> list[Tensor]:
    check_group_args(a, b, scale_a, scale_b, out_dtype, bias)
    if a.device.type == "cuda" and not statically_known_true(a.shape[1] == 0) and one_launch(a, b, scale_b, bias):
        return launch_scaled_mm_group(a, list(b), scale_a, list(scale_b), out_dtype, list(bias), graphs=launch_graphs(a))
    return [compute(a, bi, scale_a, si, out_dtype, biasi) for bi, si, biasi in zip(b, scale_b, bias)]


def scaled_mm_group_fake(a, b, scale_a, scale_b, out_dtype, bias):
    check_group_args(a, b, scale_a, scale_b, out_dtype, bias)
    return [a.new_empty((a.shape[0], bi.shape[1]), dtype=out_dtype) for bi in b]


define("scaled_mm_group", scaled_mm_group_impl, scaled_mm_group_fake)


def scaled_mm_group(a, b, scale_a, scale_b, out_dtype, bias=None) -> list:
    """``[fusepass.scaled_mm(a, b[i], scale_a, scale_b[i], out_dtype, bias[i]) for i]`` in one
    kernel launch, for 2 to 4 weights ``b`` that share the activation ``a`` and its scale.

    b: list of [K, N_i] weights of ``a``'s dtype (e.g. ``w.t()``). scale_b: list of per-tensor
    or per-channel fp32 (or bf16 / fp16) scales, one per weight. bias: list of [N_i] or None
    entries, or None (no bias). Returns a list of contiguous [M, N_i] tensors of ``out_dtype``. Same as
    ``torch.ops.fusepass.scaled_mm_group``.
    """
    if bias is None and isinstance(b, (list, tuple)):
        bias = [None] * len(b)
    _check_lists(b, scale_b, bias)
    return call("scaled_mm_group", scaled_mm_group_impl, (a, list(b), scale_a, list(scale_b), out_dtype, list(bias)),
                out_dtype, replay=False, members=(*b, *scale_b, *bias))
