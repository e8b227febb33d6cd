"""Rows 6-7 of the pattern catalogue: ``torch._scaled_mm`` on fp8 (float8_e4m3fn).

Row 6: ``torch._scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=...)`` (often with
unit scales and fp32 out) followed by a dequantization epilogue (scale multiplies, bias,
casts, views; see ``epilogue.walk``). Its own scales and bias join the epilogue.
Becomes ``fusepass.scaled_mm`` with every factor folded into scale_a / scale_b.

Row 7: ``torch._scaled_mm`` with row-wise or tensor-wise scales and nothing after it
(views aside).
Becomes ``fusepass.scaled_mm`` only where that is faster: the token count M is static
and at most ``PassConfig.fp8_direct_max_m`` (decode sizes); otherwise cuBLAS stays.

Not matched: ``scale_result``, block-wise scales, float8_e5m2.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..epilogue import Epilogue, walk
from ..graph import Axis, Rejected, aten, classify, tensor_val
from ..rewrite import Candidate, check_operands

ANCHORS = (aten._scaled_mm.default,)
NAMES = ("scaled_mm_fp8_epilogue", "scaled_mm_fp8_direct")
_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


def match(node, config) -> Candidate:
    args = dict(zip(_ARGS, node.args))
    args.update(node.kwargs)
    a, b = args["self"], args["mat2"]
    check_operands(a, b, (torch.float8_e4m3fn,))
    if args.get("scale_result") is not None:
        raise Rejected("torch._scaled_mm with scale_result (fp8 output) is not fused")
    shape = list(tensor_val(node).shape)
    ep = Epilogue()
    for name, allowed in (("scale_a", Axis.ROW), ("scale_b", Axis.COL)):
        axis = classify(args[name], shape)
        if axis not in (allowed, Axis.TENSOR) or tensor_val(args[name]).dtype != torch.float32:
            raise Rejected(f"{name} {args[name]} is not a tensor-wise or {allowed.value} fp32 scale")
        ep.add_factor(args[name], axis)
    ep.bias = args.get("bias")
    ep = walk(node, ep)
    if ep.arithmetic:  # views alone are no epilogue: those follow row 7's rule
        return Candidate("scaled_mm_fp8_epilogue", node, a, b, ep)
    M = shape[0]
    if not is_concrete_int(M) or int(M) > config.fp8_direct_max_m:
        raise Rejected(
            f"torch._scaled_mm alone with M = {M}: kept, cuBLAS is the faster choice above "
            f"M = {config.fp8_direct_max_m} (PassConfig.fp8_direct_max_m)"
        )
    return Candidate("scaled_mm_fp8_direct", node, a, b, ep)
