"""Sibling fused matmuls read one copy of the activation they quantize alike.

Matches: after the rewrites, any ``fusepass`` op call an operand of which (a quantized
activation, its scale, its zero points) is computed by the same pure ops from the same inputs
as a node earlier in the graph: a hand-written W8A8 linear quantizes its input itself, so a
Llama layer's q, k and v hold three copies of one quantization, its gate and up two. Any M.

Becomes: the call reads the earliest such node instead (the first in graph order, so before
every call it replaces an operand of); the copies go dead.

Why: Inductor fuses the copies into one kernel but still computes each and writes each, one
row reduction and one 8-bit activation more per copy. A hand-written int8 Llama-3-8B's
2048-token prefill spent 2.18 ms in its RMSNorm-and-quantize kernels against 1.68 ms for the
same model through ``fusepass.prepare``, whose siblings share one call (32 layers, CUDA
graphs, H200, ``benchmarks/NOTES.md`` run 29). The grouped launch at decode sizes
(``group.py``) takes one activation for all its members and needs this too.
"""

from __future__ import annotations

import torch.fx as fx

from .._compat import OpOverload
from .group import value_ids


def _fused(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, OpOverload) and node.target.namespace == "fusepass"


def share_activations(graph: fx.Graph) -> list[str]:
    """Point each fused call's operands at the earliest node of the same value (module
    docstring); returns the names of the calls changed."""
    calls = [n for n in graph.nodes if _fused(n)]
    if len(calls) < 2:
        return []
    ids = value_ids(graph)
    earliest: dict = {}
    for node in graph.nodes:
        earliest.setdefault(ids[node], node)
    changed = []
    for node in calls:
        args = fx.map_arg(node.args, lambda a: earliest[ids[a]])
        kwargs = fx.map_arg(node.kwargs, lambda a: earliest[ids[a]])
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed.append(node.name)
    return changed
