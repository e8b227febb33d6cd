"""What the ``torch._scaled_mm`` patterns share (``scaled_mm.py``: tensor- and row-wise;
``blockwise.py``: 1x128 x 128x128 blocks): one reader of the call's arguments, whichever
of ``aten._scaled_mm`` and ``aten._scaled_mm_v2`` (``torch.nn.functional.scaled_mm``, torch
2.12+) it is, and one rule for which fp8 matmuls fuse (by M)."""

from __future__ import annotations

from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..graph import Rejected, aten

V2 = getattr(aten, "_scaled_mm_v2", None)  # torch >= 2.12
ANCHORS = (aten._scaled_mm.default,) + ((V2.default,) if V2 is not None else ())
_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
_ARGS_V2 = ("self", "mat2", "scale_a", "recipe_a", "swizzle_a", "scale_b", "recipe_b", "swizzle_b", "bias",
            "out_dtype", "contraction_dim", "use_fast_accum")
_NO_SWIZZLE = ([], [0])  # torch.nn.functional.SwizzleType: none given, or NO_SWIZZLE


def arguments(node) -> dict:
    """The call's arguments by ``_scaled_mm``'s names. For ``_scaled_mm_v2`` also
    ``recipe_a`` / ``recipe_b`` (lists of ``torch.nn.functional.ScalingType`` values) and each
    ``scale_a`` / ``scale_b`` its one tensor (None where the call passes another number of
    scales). Rejected: swizzled scales, explicit contraction dims (neither fuses)."""
    v1 = node.target is aten._scaled_mm.default
    args = dict(zip(_ARGS if v1 else _ARGS_V2, node.args))
    args.update(node.kwargs)
    if v1:
        return args
    for side in ("a", "b"):
        if list(args.get(f"swizzle_{side}") or []) not in _NO_SWIZZLE:
            raise Rejected(f"F.scaled_mm with swizzled scales for {side}")
        scales = args[f"scale_{side}"]
        args[f"scale_{side}"] = scales[0] if len(scales) == 1 else None
        args[f"recipe_{side}"] = list(args[f"recipe_{side}"])
    if list(args.get("contraction_dim") or []):
        raise Rejected("F.scaled_mm with explicit contraction dims")
    return args


def check_fp8_m(M, config) -> None:
    """The fp8 rule: a matmul fuses at a static M up to ``config.fp8_max_m``; above it (and at
    a symbolic M, prefill's) cuBLAS keeps it, the faster there (``policy.FP8_CUBLAS_ABOVE_M``)."""
    if not is_concrete_int(M) or int(M) > config.fp8_max_m:
        raise Rejected(f"an fp8 matmul with M = {M}: kept on cuBLAS, which is faster than the fused kernel "
                       f"above M = {config.fp8_max_m} (PassConfig.fp8_max_m)")
