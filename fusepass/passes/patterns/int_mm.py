"""Rows 1-5 of the pattern catalogue: ``torch._int_mm`` and its dequantization epilogue.

Matches ``aten._int_mm(a, b)`` (int8 x int8 -> int32) followed by the elementwise chain
that ``epilogue.walk`` folds: casts anywhere, ``* scale_a`` / ``* scale_b`` in any order or
pre-multiplied (0-d, [M, 1], [M], [1, N], [N], Python numbers), an optional ``+ bias``
(out dtype or fp32), 2-D <-> 3-D views around it (row 3), and before the scaling an
optional activation zero-point correction:

- ``acc - azp_adj`` or ``acc - z_a * colsum`` with a per-tensor ``z_a`` (row 4),
- ``acc - azp[M, 1] * azp_adj[1, N]`` (row 5).

Becomes ``fusepass.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)`` (rows 1-3) or
``fusepass.scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)`` (4-5),
plus a view back to 3-D where the chain ended in one.
"""

from __future__ import annotations

import torch

from ..epilogue import walk
from ..graph import Rejected, aten
from ..rewrite import Candidate, check_operands

ANCHORS = (aten._int_mm.default,)
NAMES = ("int_mm_scaled", "int_mm_azp_per_tensor", "int_mm_azp_per_token")


def match(node, config) -> Candidate:
    a, b = node.args[0], node.args[1]
    ep = walk(node, allow_azp=True)
    if not ep.scaled:
        raise Rejected("no scale multiply follows the int32 accumulator")
    check_operands(a, b, (torch.int8,), azp=ep.azp_adj is not None)
    if ep.azp_adj is None:
        name = "int_mm_scaled"
    else:
        name = "int_mm_azp_per_token" if ep.azp is not None else "int_mm_azp_per_tensor"
    return Candidate(name, node, a, b, ep)
