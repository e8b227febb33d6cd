"""The pipeline's first step: opaque nodes expanded into the ATen forms the patterns match.

A layer above the pass may trace a module as one op node whose forms it registers here
(``EXPANSIONS[op] = forms``): ``fusepass.prepare``'s linears are one ``fusepass::w8a8_linear``
node each for Dynamo and AOTAutograd, where their forms (the per-token quantization and the
dequantized product, about 20 ops against ``nn.Linear``'s 2) made every stage of a compile trace
ten times the nodes, three times over (docs/PERFORMANCE.md, "Compile time"). Here each node is
replaced by the trace of its forms on its arguments (calls of one signature share one trace, as
the lowering's do), each new node keeping the node's source line and module; then the copies of
one computation (siblings' quantizations of one activation) become one, as AOTAutograd's own
common-subexpression elimination left them, and the patterns find the forms as if the forward
had been traced.
"""

from __future__ import annotations

import torch.fx as fx

from .lower import replace_calls

NAME = "expanded"
EXPANSIONS: dict = {}  # op overload -> a function of its schema arguments returning its output
# (what explain and the later steps read of a node: where it came from)
_WHERE = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr", "original_aten")


def expand(graph: fx.Graph) -> int:
    """Replace every call of an op in ``EXPANSIONS`` by its forms; returns how many."""
    if not EXPANSIONS or not any(graph.find_nodes(op="call_function", target=op) for op in EXPANSIONS):
        return 0
    before = set(graph.nodes)
    count = replace_calls(graph, EXPANSIONS, keep_meta=_WHERE)
    _merge_copies(graph, [n for n in graph.nodes if n not in before])
    return count


def _merge_copies(graph: fx.Graph, new: list[fx.Node]) -> None:
    """Each of the ``new`` nodes that computes what an earlier one of them does (same op, same
    arguments) replaced by it. The forms are pure ATen ops: no randomness, no mutation."""
    seen = {}
    for node in new:
        if node.op != "call_function":
            continue
        try:
            key = (node.target, _hashable(node.args), _hashable(node.kwargs))
            hash(key)
        except TypeError:  # (a symbolic size among the arguments: left as it is)
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_hashable, value))
    if isinstance(value, dict):
        return tuple((k, _hashable(v)) for k, v in sorted(value.items()))
    if isinstance(value, float):  # (nan, which the forms hold, equals no nan)
        return ("float", value.hex())
    return value
