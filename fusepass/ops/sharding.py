"""Sharding rules: ``torch.ops.fusepass.*`` (and ``aten._int_mm``) on DTensors.

Registered with DTensor's ``register_sharding`` on import of this module, which
``fusepass.ops`` imports right after registering the ops: ``import fusepass`` is all a DTensor
call needs (it costs ~25 ms of fusepass's ~4.5 s import). Each rule lists, for one mesh
dimension, placements under which the op on each rank's local tensors gives the op's result
on the global ones; DTensor expands them over the mesh, picks the cheapest for the inputs'
placements and redistributes the inputs to it. With ``a`` [M, K] and ``b`` [K, N]:

- everything Replicate -> Replicate;
- rows (M): ``a`` Shard(0), per-token ``scale_a`` and ``azp`` Shard(0) -> out Shard(0);
- columns (N, a column-wise weight): ``b`` Shard(1), per-channel ``scale_b``, ``bias`` and
  ``azp_adj`` sharded on their N axis -> out Shard(1);
- contraction (K, a row-wise weight): ``a`` Shard(1), ``b`` Shard(0), scales Replicate ->
  out Partial(sum). The epilogue is linear in the accumulator, so the ranks' results sum
  to the global one, up to each rank rounding its part to ``out_dtype`` (as for any float
  matmul DTensor splits on K). A term added once to the output (``bias``, ``azp_adj``) must
  not be added once per rank: this rule is offered only where each is absent or already
  Partial(sum) on every mesh dimension, each rank holding its share (the column sums of its
  own K slice; or, rank 0 the whole term and the others zeros). Never a replicated term made
  Partial: DTensor would do that by dividing it by the world size (inexact; for an int32
  zero-point term it changes the dtype). Otherwise DTensor redistributes to another rule.

``scaled_mm_blockwise`` has the replicate and rows rules (its ``scale_a`` [M, ceil(K/128)]
sharded on M with ``a``). Columns and contraction would need shard boundaries on 128-wide
blocks of N and K, which DTensor's even split does not promise; DTensor gathers instead.

Per-tensor scales (numel 1) are Replicate in every rule. ``aten._int_mm`` gets the int8
rules too, unless this torch has its own: DTensor has none (torch 2.11, 2.13), and a
hand-written W8A8 model (``fusepass/demo/handwritten.py``) needs one to run sharded.
"""

from __future__ import annotations

import torch

from .._compat import dtensor_spec, schema

aten = torch.ops.aten


def _dims(a, b):
    return a.tensor_meta.shape[0], b.tensor_meta.shape[1]  # M, N


def _numel(spec) -> int:
    return spec.tensor_meta.shape.numel()


def _rules(op_name, args: dict):
    """``[(out placement, {argument: placement})]`` for one mesh dimension."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    a, b = args["a"], args["b"]
    M, N = _dims(a, b)
    R = Replicate()

    def per_token(t):  # scale_a: per-tensor (numel 1) stays whole
        return Shard(0) if _numel(t) == M and M != 1 else R

    def per_channel(t):  # scale_b: [1, N] or [N], or per-tensor
        return Shard(len(t.tensor_meta.shape) - 1) if _numel(t) == N and N != 1 else R

    def already_partial(t):
        return all(p == Partial("sum") for p in t.placements)

    present = {k for k, v in args.items() if v is not None}
    rules = []
    # Replicate; rows (M); columns (N); contraction (K).
    rules.append((R, {k: R for k in present}))
    if op_name == "scaled_mm_blockwise":
        rows = {k: R for k in present} | {"a": Shard(0), "scale_a": Shard(0)}
        return rules + [(Shard(0), rows)]
    rows = {"a": Shard(0), "b": R}
    cols = {"a": R, "b": Shard(1)}
    contraction = {"a": Shard(1), "b": Shard(0)}
    if op_name != "int_mm":
        rows |= {"scale_a": per_token(args["scale_a"]), "scale_b": R}
        cols |= {"scale_a": R, "scale_b": per_channel(args["scale_b"])}
        contraction |= {"scale_a": R, "scale_b": R}
        if "bias" in present:
            rows["bias"] = R
            cols["bias"] = Shard(0)
            contraction["bias"] = Partial("sum") if already_partial(args["bias"]) else None
        if "azp_adj" in present:
            adj = args["azp_adj"]
            rows["azp_adj"] = R
            cols["azp_adj"] = Shard(len(adj.tensor_meta.shape) - 1)
            contraction["azp_adj"] = Partial("sum") if already_partial(adj) else None
        if "azp" in present:
            rows["azp"], cols["azp"], contraction["azp"] = Shard(0), R, R
    rules += [(Shard(0), rows), (Shard(1), cols)]
    if all(p is not None for p in contraction.values()):
        rules.append((Partial("sum"), contraction))
    return rules


def _register(op, op_name: str, names: tuple = ()) -> None:
    """``names``: the schema's argument names as fusepass's ops call them (aten: self, mat2)."""
    from torch.distributed.tensor.experimental import register_sharding

    DTensorSpec = dtensor_spec()
    schema_names = [arg.name for arg in schema(op).arguments]
    rename = dict(zip(schema_names, names or schema_names))

    def rule(*args, **kwargs):
        # The placements returned are for the tensor inputs in DTensor's order: positional
        # then keyword, as called (entries for anything else are None and skipped).
        order = [rename[k] for k in schema_names[: len(args)] + list(kwargs)]
        bound = dict(zip(order, (*args, *kwargs.values())))
        tensors = {k: v if isinstance(v, DTensorSpec) else None for k, v in bound.items()}
        return [([out], [placements.get(k) if tensors[k] is not None else None for k in order])
                for out, placements in _rules(op_name, {k: tensors.get(k) for k in rename.values()})]

    register_sharding(op)(rule)


def _has_rule(op) -> bool:
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    return any(op in getattr(prop, table, {}) for table in
               ("op_to_rules", "op_strategy_funcs", "op_single_dim_strategy_funcs"))


def register() -> None:
    """Register the rules (idempotent: a later call replaces them with the same)."""
    if not torch.distributed.is_available():
        return
    for name in ("scaled_mm", "scaled_mm_azp", "int_mm", "scaled_mm_blockwise"):
        _register(getattr(torch.ops.fusepass, name).default, name)
    if not _has_rule(aten._int_mm.default):
        _register(aten._int_mm.default, "int_mm", ("a", "b"))


register()
