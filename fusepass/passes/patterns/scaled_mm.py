"""``scaled_mm_fp8_epilogue`` and ``scaled_mm_fp8_direct`` (``docs/PATTERNS.md``): fp8
(float8_e4m3fn) scaled matmuls.

Matches ``torch._scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=...)`` and, where
the installed torch has it (2.12+), ``torch.nn.functional.scaled_mm`` (``aten._scaled_mm_v2``,
what transformers' compressed-tensors fp8 path calls) with tensor-wise or row-wise recipes,
no swizzle and the default contraction dims; then any epilogue after it (scale
multiplies, bias, casts, views; see ``epilogue.walk``). Its own scales and bias join the
epilogue.

- ``scaled_mm_fp8_epilogue``: with arithmetic after the matmul (often unit scales and fp32 out).
- ``scaled_mm_fp8_direct``: nothing after it but views.

Both become ``fusepass.scaled_mm`` with every factor folded into scale_a / scale_b, under
one rule, where the fused kernel is the faster: a static M at most
``PassConfig.fp8_max_m``. Above it (and for a symbolic M, prefill's) cuBLAS keeps the
matmul, and Inductor the elementwise ops after it.

Not matched: ``scale_result``, block-wise or swizzled scales (``blockwise.py``, tried first, takes
DeepSeek-V3's 1x128 x 128x128 recipe), float8_e5m2.
"""

from __future__ import annotations

import torch

from ..epilogue import Epilogue, walk
from ..graph import Axis, Rejected, classify, describe, tensor_val
from ..rewrite import Candidate, check_operands
from . import scaled_mm_args

ANCHORS = scaled_mm_args.ANCHORS
NAMES = ("scaled_mm_fp8_epilogue", "scaled_mm_fp8_direct")
_TENSOR_OR_ROW_WISE = ([0], [1])  # torch.nn.functional.ScalingType values


def _arguments(node) -> dict:
    """The matmul's arguments (``scaled_mm_args.arguments``), its scales tensor- or row-wise."""
    args = scaled_mm_args.arguments(node)
    for side in ("a", "b"):
        recipe = args.get(f"recipe_{side}")
        if recipe is not None and (args[f"scale_{side}"] is None or recipe not in _TENSOR_OR_ROW_WISE):
            raise Rejected(f"scaled_mm with the scale recipe {recipe} for {side}: only tensor-wise and row-wise "
                           "scales fuse (block-wise ones do not)")
    return args


def match(node, config) -> Candidate:
    args = _arguments(node)
    a, b = args["self"], args["mat2"]
    check_operands(a, b, (torch.float8_e4m3fn,))
    if args.get("scale_result") is not None:
        raise Rejected("torch._scaled_mm with scale_result (fp8 output) is not fused")
    shape = list(tensor_val(node).shape)
    ep = Epilogue()
    for name, allowed in (("scale_a", Axis.ROW), ("scale_b", Axis.COL)):
        scale = args[name]
        axis = classify(scale, shape)
        if axis not in (allowed, Axis.TENSOR) or tensor_val(scale).dtype != torch.float32:
            raise Rejected(f"{name} ({describe(scale)}) is not a tensor-wise or {allowed.value} fp32 scale")
        ep.add_factor(scale, axis)
    ep.bias = args.get("bias")
    scaled_mm_args.check_fp8_m(shape[0], config)
    ep = walk(node, ep)
    return Candidate("scaled_mm_fp8_epilogue" if ep.arithmetic else "scaled_mm_fp8_direct", node, a, b, ep)
