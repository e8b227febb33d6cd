"""A matched candidate and the rewrite that replaces it with one fused op call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.checks import MAX_K_INT8, MAX_K_INT8_AZP, MIN_CAPABILITY, MIN_FP8_CAPABILITY, OUT_DTYPES
from .epilogue import Epilogue
from .graph import ASSERT_OPS, Inserter, Rejected, aten, is_call, tensor_val

fusepass = torch.ops.fusepass


@dataclass
class Candidate:
    """A quantized matmul and its epilogue, ready to become ``fusepass.scaled_mm[_azp]``.

    ``a`` [M, K] and ``b`` [K, N] are the quantized operands; ``a_view`` (shape args) views
    a 3-D ``a`` to 2-D, ``b_t`` transposes an [N, K] ``b``.
    """

    pattern: str
    anchor: fx.Node
    a: fx.Node
    b: fx.Node
    ep: Epilogue
    a_view: list | None = None
    b_t: bool = False

    @property
    def last(self) -> fx.Node:
        return self.ep.chain[-1] if self.ep.chain else self.anchor

    @property
    def op_name(self) -> str:
        return "fusepass.scaled_mm_azp" if self.ep.azp_adj is not None else "fusepass.scaled_mm"


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
    if va.device.type == "cuda" and torch.cuda.is_available():  # (fake CUDA graphs trace on CPU hosts)
        need = MIN_CAPABILITY if va.dtype == torch.int8 else MIN_FP8_CAPABILITY
        if torch.cuda.get_device_capability(va.device) < need:
            raise Rejected(f"{va.device} is older than sm_{need[0]}{need[1]}, which {va.dtype} needs")


def _scales(ins: Inserter, ep: Epilogue, device):
    """scale_a and scale_b: per-token factors go to scale_a, per-channel ones to scale_b;
    per-tensor ones go to scale_b, except the first when scale_a would otherwise be empty."""
    rows = [ins.fp32(ins.flat(r)) for r in ep.rows]
    cols = [ins.fp32(ins.flat(c)) for c in ep.cols]
    # Tensors before Python numbers, so a lone number never displaces a tensor scale.
    scalars = sorted((ins.scalar(s, device) for s in ep.scalars), key=lambda s: not isinstance(s, fx.Node))
    a_side = rows or scalars[:1]
    b_side = cols + (scalars if rows else scalars[1:])
    one = lambda: ins.constant(1.0, device)  # noqa: E731
    return ins.product(a_side, device) or one(), ins.product(b_side, device) or one()


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
        sa, sb = _scales(ins, ep, device)
        bias = None if ep.bias is None else ins.flat(ep.bias)
        if ep.azp_adj is not None:
            azp = None if ep.azp is None else ins.flat(ep.azp)
            out = ins.call(fusepass.scaled_mm_azp.default, a, b, sa, sb, out_dtype, ins.flat(ep.azp_adj), azp, bias)
        else:
            out = ins.call(fusepass.scaled_mm.default, a, b, sa, sb, out_dtype, bias)
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
