"""Sibling fused matmuls read one copy of the activation they quantize alike.

Matches: after the rewrites, joins, groups and in-launch quantizations, any ``fusepass`` op
call an operand of which is computed by the same pure ATen / prims ops from the same inputs as
a node earlier in the graph (every node operand is looked at; in practice the quantized
activation, its scale and zero points, which each hand-written W8A8 linear computes itself:
a Llama layer's q, k and v hold three copies of one quantization, its gate and up two). Any M.
A quantization that goes through a multi-output op (``x.abs().max(dim=-1)``: the op and its
``getitem``) is not one value to this pass, as in ``graph.value_ids``.

Becomes: the call reads the earliest such node instead (the first in graph order, so before
every call it replaces an operand of); the copies go dead.

Why: where no join or group took the siblings (above ``group_max_m``: prefill), Inductor fused
the copies into one kernel but still computed and wrote each, a row reduction and an 8-bit
activation more per copy (a hand-written model's prefill spent a third more in those kernels
than the same model prepared: docs/PERFORMANCE.md, "Why the code is as it is": "Sharing"). It runs
last, since a call that quantizes its row in its own launch (``quantize_in.py``) must be that
row's only user.
"""

from __future__ import annotations

import torch.fx as fx

from .._compat import OpOverload
from .graph import value_ids

NAME = "shared_activation"


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
