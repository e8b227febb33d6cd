"""Group sibling fused matmuls at decode sizes into one ``fusepass.scaled_mm_group`` call.

Matches: after the rewrites, 2 or more ``fusepass.scaled_mm`` calls whose activation and
activation scale are the same value (the same node, or nodes computing it by the same pure
ops from the same inputs: each linear quantizes its input itself, so a Llama layer's q, k
and v hold three copies of one quantization), with the same ``out_dtype``, weights of one
layout, one scale granularity and bias or none, at a static M of at most
``PassConfig.group_max_m`` (fp8: at most ``policy.FP8_CUBLAS_ABOVE_M``, above which its own
launch takes cuBLAS where ``launch.cublas_takes_fp8`` holds), none computed from another's
result.

Becomes: one ``fusepass.scaled_mm_group`` call per 2 to 4 such calls (in graph order), each
member's users reading its item of the result; the copies of the quantization then go dead.

Why: a default-mode decode step is host-bound, and a launch costs host time; the group is
one launch where there were 2-4 (a Llama layer's q/k/v: 3 of its 7 GEMM launches). The group
takes the config of the weight the members would make joined, with its split of K (at M <= 16
only where decode launches split: inside CUDA graphs, with ``split_k_outside_cuda_graphs``, and
in eager calls of the op; ``policy.decode_splits``), and so runs as ``fusepass.prepare``'s
joined weight does. Prefill sizes keep their
own tuned launches (``scaled_mm``'s TMA configs).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .._compat import stable_topological_sort
from ..kernels.policy import FP8_CUBLAS_ABOVE_M, MAX_MEMBERS, launch_variant
from .graph import Inserter, tensor_val, value_ids

fusepass = torch.ops.fusepass
NAME = "scaled_mm_group"


def _group_key(node: fx.Node, ids: dict, max_m: int):
    """What members of one group share; None for a call that cannot join a group."""
    a, b, scale_a, scale_b, out_dtype, bias = node.args
    M = tensor_val(a).shape[0]
    if not is_concrete_int(M) or int(M) > max_m:
        return None
    if tensor_val(a).dtype != torch.int8 and int(M) > FP8_CUBLAS_ABOVE_M:
        return None  # (its own launch may take cuBLAS there, faster than the group's pointer loads)
    variant = launch_variant(tensor_val(b), tensor_val(scale_b), bias)
    if variant is None:  # (symbolic strides: not hashable, not comparable here)
        return None
    return ids[a], ids[scale_a], out_dtype, variant


def _independent(members: list) -> list:
    """The members (in graph order) none of which is computed from an earlier one's result."""
    kept, tainted = [members[0]], {members[0]}
    node = members[0].next
    while node is not members[-1].next:
        if any(arg in tainted for arg in node.all_input_nodes):
            tainted.add(node)
        elif node in members:
            kept.append(node)
            tainted.add(node)
        node = node.next
    return kept


def _replace(graph: fx.Graph, members: list) -> None:
    a, _, scale_a, _, out_dtype, _ = members[0].args
    ins = Inserter(graph, members[-1])
    group = ins.call(fusepass.scaled_mm_group.default, a, [m.args[1] for m in members], scale_a,
                     [m.args[3] for m in members], out_dtype, [m.args[5] for m in members])
    for i, member in enumerate(members):
        with graph.inserting_before(members[-1]):
            item = graph.call_function(operator.getitem, (group, i))
        item.meta["val"] = group.meta["val"][i]
        item.meta["stack_trace"] = member.meta.get("stack_trace")
        member.replace_all_uses_with(item)
        graph.erase_node(member)


def group_siblings(graph: fx.Graph, max_m: int) -> list[list[str]]:
    """Replace each group of sibling ``scaled_mm`` calls (see the module docstring) by one
    ``scaled_mm_group`` call; returns the names of the calls grouped, per group."""
    calls = [n for n in graph.find_nodes(op="call_function", target=fusepass.scaled_mm.default)]
    if len(calls) < 2:
        return []
    ids = value_ids(graph)
    by_key: dict = {}
    for node in calls:
        key = _group_key(node, ids, max_m)
        if key is not None:
            by_key.setdefault(key, []).append(node)
    done = []
    for siblings in by_key.values():
        while len(siblings) >= 2:
            # In the current order: each group is sorted into place before the next is
            # formed, so a dependency through an earlier group (a cycle between two groups)
            # shows as one here.
            position = {n: i for i, n in enumerate(graph.nodes)}
            siblings.sort(key=position.__getitem__)
            members = _independent(siblings)[:MAX_MEMBERS]
            siblings = [s for s in siblings if s not in members]
            if len(members) >= 2:
                done.append([m.name for m in members])
                _replace(graph, members)
                stable_topological_sort(graph)
    return done
