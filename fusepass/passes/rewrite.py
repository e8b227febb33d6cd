"""A matched candidate and the rewrite that replaces it with one fused op call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.checks import (
    AZP_DTYPES,
    MAX_K_INT8,
    MAX_K_INT8_AZP,
    OUT_DTYPES,
    SCALE_DTYPES,
    gpu_too_old,
)
from .epilogue import INT_DTYPES, Epilogue
from .graph import ASSERT_OPS, Inserter, Rejected, aten, cast_dtype, is_call, prims, tensor_val

fusepass = torch.ops.fusepass


@dataclass
class Candidate:
    """A quantized matmul and its epilogue, ready to become ``fusepass.scaled_mm[_azp]``.

    ``a`` [M, K] and ``b`` [K, N] are the quantized operands; ``a_view`` (shape args) views
    a 3-D ``a`` to 2-D, ``b_t`` transposes an [N, K] ``b``. ``a_zero_point``: the zero point
    (per-token or per-tensor) subtracted from ``a`` before the matmul (dequantize-then-matmul
    forms); the op's ``azp_adj`` is then the column sums of ``b``.
    """

    pattern: str
    anchor: fx.Node
    a: fx.Node
    b: fx.Node
    ep: Epilogue
    a_view: list | None = None
    b_t: bool = False
    a_zero_point: fx.Node | float | None = None

    @property
    def last(self) -> fx.Node:
        return self.ep.chain[-1] if self.ep.chain else self.anchor

    @property
    def op_name(self) -> str:
        azp = self.ep.azp_adj is not None or self.a_zero_point is not None
        return "fusepass.scaled_mm_azp" if azp else "fusepass.scaled_mm"

    def insert_op(self, ins: Inserter, a: fx.Node, b: fx.Node, out_dtype, device) -> fx.Node:
        """Insert the fused op on the (viewed) operands; a pattern with an op of its own
        overrides this (patterns/blockwise.py)."""
        ep = self.ep
        sa, sb = _scales(ins, ep, device)
        bias = None if ep.bias is None else ins.flat(ep.bias)
        azp_adj = azp = None
        if self.a_zero_point is not None:
            azp_adj, azp = _activation_zero_point(ins, self.a_zero_point, b)
        elif ep.azp_adj is not None:
            azp_adj, azp = ep.azp_adj, ep.azp
        if azp_adj is None:
            return ins.call(fusepass.scaled_mm.default, a, b, sa, sb, out_dtype, bias)
        azp = None if azp is None else _zero_point(ins, azp)
        return ins.call(fusepass.scaled_mm_azp.default, a, b, sa, sb, out_dtype, _zero_point(ins, azp_adj), azp, bias)


def check_operands(a: fx.Node, b: fx.Node, dtypes, *, azp: bool = False) -> None:
    """The quantized operands the ops take: same dtype, same supported device, exact K."""
    va, vb = tensor_val(a), tensor_val(b)
    if va.dtype not in dtypes or vb.dtype != va.dtype:
        raise Rejected(f"operands are {va.dtype} x {vb.dtype}; fused ops take int8 or float8_e4m3fn pairs")
    if va.device != vb.device or va.device.type not in ("cpu", "cuda"):
        raise Rejected(f"operands on {va.device} and {vb.device}; fused ops run on one cpu or cuda device")
    if va.dtype == torch.int8:
        max_k = MAX_K_INT8_AZP if azp else MAX_K_INT8
        # A symbolic K passes here; the op checks the real K at run time.
        if statically_known_true(va.shape[-1] > max_k):
            raise Rejected(f"K = {va.shape[-1]} exceeds {max_k}, the largest exact for int32 accumulation")
    old = gpu_too_old(va.device, va.dtype)
    if old is not None:
        raise Rejected(f"{va.device} is older than sm_{old[0][0]}{old[0][1]}, which {va.dtype} needs")


def _scales(ins: Inserter, ep: Epilogue, device):
    """scale_a and scale_b: per-token factors go to scale_a, per-channel ones to scale_b;
    per-tensor ones go to scale_b, except the first when scale_a would otherwise be empty."""
    rows = [ins.flat(r) for r in ep.rows]
    cols = [ins.flat(c) for c in ep.cols]
    # Tensors before Python numbers, so a lone number never displaces a tensor scale.
    scalars = sorted((ins.scalar(s, device, fp32=False) for s in ep.scalars), key=lambda s: not isinstance(s, fx.Node))
    a_side = rows or scalars[:1]
    b_side = cols + (scalars if rows else scalars[1:])

    def side(factors):
        # One tensor goes to the op as it is (it widens a bf16 / fp16 scale itself: no cast
        # kernel for a weight's scale every step); a product is taken in fp32.
        # (the walker takes multipliers of FLOAT_DTYPES only, which are the ops' SCALE_DTYPES)
        if len(factors) == 1 and isinstance(factors[0], fx.Node) and tensor_val(factors[0]).dtype in SCALE_DTYPES:
            return factors[0]
        return ins.product([ins.fp32(f) if isinstance(f, fx.Node) else f for f in factors], device) or \
            ins.constant(1.0, device)

    return side(a_side), side(b_side)


def _zero_point(ins: Inserter, node: fx.Node) -> fx.Node:
    """A zero-point term as the op takes it: a vector of int32, int64 or fp32 (narrower
    integers, such as int8 zero points, widen to int32: exact)."""
    node = ins.flat(node)
    if tensor_val(node).dtype in AZP_DTYPES:
        return node
    return ins.call(prims.convert_element_type.default, node, torch.int32)


def _activation_zero_point(ins: Inserter, z, b: fx.Node):
    """(azp_adj, azp) of ``(a - z) @ b`` = ``a @ b - z * colsum(b)``: a per-token ``z`` goes to
    azp, a per-tensor one (or one row: M = 1) multiplies the column sums. Integers stay
    integers where ``z`` is a cast of them; float zero points go in fp32."""
    colsum = ins.call(aten.sum.dim_IntList, b, [0], dtype=torch.int32)  # exact: |sum| <= 128 K
    if not isinstance(z, fx.Node):
        return ins.call(aten.mul.Tensor, colsum, z), None
    if cast_dtype(z) is not None and tensor_val(z.args[0]).dtype in INT_DTYPES:
        z = z.args[0]
    z = ins.flat(z) if tensor_val(z).dtype in INT_DTYPES else ins.fp32(ins.flat(z))
    if statically_known_true(tensor_val(z).numel() == 1):
        return ins.call(aten.mul.Tensor, colsum, z), None
    return colsum, _zero_point(ins, z)


def emit(graph: fx.Graph, cand: Candidate) -> fx.Node:
    """Insert the fused op for ``cand``, reroute the epilogue's users to it and erase the
    replaced nodes. Raises Rejected (leaving the graph as it was) if the op refuses."""
    ep, last = cand.ep, cand.last
    out_dtype = tensor_val(last).dtype
    if out_dtype not in OUT_DTYPES:
        raise Rejected(f"the epilogue ends in {out_dtype}; fused ops return bf16, fp16 or fp32")
    ins = Inserter(graph, last)
    device = tensor_val(cand.anchor).device
    try:
        a = cand.a if cand.a_view is None else ins.call(aten.view.default, cand.a, cand.a_view)
        b = ins.call(aten.permute.default, cand.b, [1, 0]) if cand.b_t else cand.b
        out = cand.insert_op(ins, a, b, out_dtype, device)
        if ep.view is not None:
            out = ins.call(aten.view.default, out, ep.view.args[1])
    except (TypeError, ValueError) as e:  # the op's own checks refused the arguments
        ins.rollback()
        raise Rejected(str(e)) from e
    out.meta["stack_trace"] = last.meta.get("stack_trace")
    last.replace_all_uses_with(out)
    for node in reversed([cand.anchor, *ep.chain]):
        for check in [u for u in node.users if is_call(u, *ASSERT_OPS)]:
            graph.erase_node(check)  # asserts on values that no longer exist
        graph.erase_node(node)
    return out
