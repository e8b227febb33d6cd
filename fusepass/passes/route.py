"""Int8 matmuls the pass leaves alone, where ``torch._int_mm`` cannot run them on CUDA.

cuBLAS's int8 GEMM behind ``torch._int_mm`` needs M > 16 and K, N multiples of 8 on
CUDA: a model whose int8 epilogue did not fuse would stop there at run time (batch-1
decode, say), although fusepass could run it. Such a matmul becomes ``fusepass.int_mm``,
the fused kernel without an epilogue: the same exact int32 product, at every M. A
symbolic M may be <= 16, so it is routed too.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .graph import Inserter, aten, tensor_val

ROUTED = "int_mm_routed"  # its counter name


def _cublas_runs(M, K, N) -> bool:
    concrete = all(map(is_concrete_int, (M, K, N)))
    return concrete and int(M) > 16 and int(K) % 8 == 0 and int(N) % 8 == 0


def needs_route(node: fx.Node) -> bool:
    """An ``aten._int_mm`` on CUDA that cuBLAS may not run."""
    if node.target is not aten._int_mm.default:
        return False
    a, b = (tensor_val(x) for x in node.args[:2])
    if a.device.type != "cuda" or a.dtype != torch.int8 or b.dtype != torch.int8:
        return False
    return not _cublas_runs(a.shape[0], a.shape[1], b.shape[1])


def route(graph: fx.Graph, node: fx.Node) -> None:
    """Replace ``node`` (an ``aten._int_mm``) by ``fusepass.int_mm`` on the same operands."""
    out = Inserter(graph, node).call(torch.ops.fusepass.int_mm.default, *node.args[:2])
    out.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_all_uses_with(out)
    graph.erase_node(node)
