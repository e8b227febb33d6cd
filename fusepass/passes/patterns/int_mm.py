"""``int_mm_scaled``, ``int_mm_azp_per_tensor``, ``int_mm_azp_per_token`` (``docs/PATTERNS.md``):
an int8 x int8 -> int32 matmul and its epilogue.

Matches ``aten._int_mm(a, b)``, and ``aten.mm`` of int8 tensors cast to int32 (what
``torch._higher_order_ops.out_dtype(mm, int32, a, b)``, torchao's compile path, becomes
on CPU), followed by the elementwise chain ``epilogue.walk`` folds: casts anywhere,
``* scale_a`` / ``* scale_b`` in any order or pre-multiplied (0-d, [M, 1], [M], [1, N],
[N], Python numbers, or those expanded to [M, N]), an optional ``+ bias`` (out dtype or
fp32), 2-D <-> 3-D views around it, and before the scaling an optional
activation zero-point correction:

- ``acc - azp_adj`` or ``acc - z_a * colsum`` with a per-tensor ``z_a`` (``int_mm_azp_per_tensor``),
- ``acc - azp[M, 1] * azp_adj[1, N]`` (``int_mm_azp_per_token``).

Also torchao's CPU form of int8 (oneDNN's u8s8 kernel, taken on CPUs with AVX512-VNNI and
no AMX): ``a`` shifted to uint8 by ``(a.to(int32) + 128).to(uint8)`` and the shift removed
by ``- 128 * b.sum(0)`` right after the matmul; the int8 ``a`` is used directly and the
correction cancels, so an asymmetric activation's zero point may still follow it.

Becomes ``fusepass.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)`` (``int_mm_scaled``) or
``fusepass.scaled_mm_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias)`` (4-5),
plus a view back to 3-D where the chain ended in one.
"""

from __future__ import annotations

import torch

from ..epilogue import walk
from ..graph import Rejected, aten, cast_dtype, is_call, tensor_val
from ..rewrite import Candidate, check_operands

ANCHORS = (aten._int_mm.default, aten.mm.default)
NAMES = ("int_mm_scaled", "int_mm_azp_per_tensor", "int_mm_azp_per_token")


def _cast_from(node, src, dst):
    """``x`` if ``node`` is ``x.to(dst)`` with ``x`` of dtype ``src``, else None."""
    if cast_dtype(node) == dst and tensor_val(node.args[0]).dtype == src:
        return node.args[0]
    return None


def _u8_shifted(a):
    """The int8 ``x`` of ``(x.to(int32) + 128).to(uint8)``, else None."""
    add = _cast_from(a, torch.int32, torch.uint8)
    if is_call(add, aten.add.Tensor) and add.args[1] == 128:
        return _cast_from(add.args[0], torch.int8, torch.int32)
    return None


def _is_shift_correction(term, b) -> bool:
    """``term`` is ``b.sum(0, keepdim, dtype=int32) * 128``: the u8 shift's contribution."""
    if not is_call(term, aten.mul.Tensor) or 128 not in term.args[:2]:
        return False
    total = term.args[0] if term.args[1] == 128 else term.args[1]
    return (
        is_call(total, aten.sum.dim_IntList)
        and total.args[0] is b
        and list(total.args[1]) == [0]
        and total.kwargs.get("dtype") == torch.int32
    )


def match(node, config) -> Candidate | None:
    a, b = node.args[0], node.args[1]
    if node.target is aten.mm.default:  # int32 mm of int8 casts, or not ours
        a, b = _cast_from(a, torch.int8, torch.int32), _cast_from(b, torch.int8, torch.int32)
        if a is None or b is None:
            return None
    shifted = _u8_shifted(a)
    ep = walk(node, allow_azp=True,
              cancels=None if shifted is None else (lambda term: _is_shift_correction(term, b)))
    if shifted is not None:
        if ep.cancelled is None:
            raise Rejected("uint8 activations without the matching - 128 * b.sum(0) correction")
        a = shifted
    if not ep.scaled:
        raise Rejected(ep.stop or "no scale multiply follows the int32 accumulator")
    check_operands(a, b, (torch.int8,), azp=ep.azp_adj is not None)
    if ep.azp_adj is None:
        name = "int_mm_scaled"
    else:
        name = "int_mm_azp_per_token" if ep.azp is not None else "int_mm_azp_per_tensor"
    return Candidate(name, node, a, b, ep)
