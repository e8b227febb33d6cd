"""``fusepass.prepare(model)``: a quantized model's linears as plain-tensor ``W8A8Linear``s,
once, before ``torch.compile``.

Why a step of its own: a torchao model's weights are tensor subclasses, and whatever the
backend does with them, Dynamo guards each one's metadata on every call (in Python:
``__tensor_flatten__`` per weight) and AOTAutograd takes each apart on every call unless the
backend rewrites the graph, which in turn keeps the AOTAutograd cache from serving it. Those
costs grow with the number of quantized weights: at Llama-3-8B's full depth (224 weights) they
were most of a batch-1 decode step's host time (benchmarks/NOTES.md, "full depth"). Plain
tensors carry none of it: Dynamo guards them as it guards a bf16 model's, in C++, and the
caches hit. Converting in place also lets siblings share one buffer (``linear.py``).

What it converts (the checkpoint's quantized values and scales, never re-quantized):

- torchao ``Int8Tensor`` weights with dynamic per-token activations
  (``Int8DynamicActivationInt8WeightConfig``, symmetric or asymmetric activations);
- torchao ``Float8Tensor`` weights with per-row scales and dynamic per-token e4m3 activations
  (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``).

Anything else quantized (weight-only, per-group, static or pre-scaled activations, another
library's type) is left as it is, and the returned ``Preparation`` says why, by module.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from .linear import Act, Joint, W8A8Linear

log = logging.getLogger("fusepass.prepare")


@dataclass
class Preparation:
    """What ``prepare`` did, by module path: ``converted`` (path -> scheme), ``left``
    (path -> why not), ``joined`` (the groups of siblings that share one weight buffer)."""

    converted: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    joined: list[list[str]] = field(default_factory=list)

    def __str__(self) -> str:
        n = len(self.converted)
        by_scheme = defaultdict(int)
        for scheme in self.converted.values():
            by_scheme[scheme] += 1
        schemes = ", ".join(f"{k} {v}" for k, v in sorted(by_scheme.items()))
        lines = [f"fusepass.prepare: {n} quantized linear{'s' * (n != 1)} converted"
                 + (f" ({schemes})" if schemes else "") + f", {len(self.left)} left as they are, "
                 f"{sum(map(len, self.joined))} in {len(self.joined)} shared buffers"]
        lines += [f"  left {path}: {why}" for path, why in self.left.items()]
        return "\n".join(lines)


@dataclass
class _Quantized:
    """One linear's checkpoint values: weight (N, K), per-row scale (N,) fp32, activations."""

    weight: torch.Tensor
    scale: torch.Tensor
    act: Act


def _torchao(w) -> _Quantized | str | None:
    """A torchao weight's values, or why it cannot be converted; None for no torchao weight."""
    cls = type(w)
    if not cls.__module__.startswith("torchao"):
        return None
    name = cls.__name__
    if name not in ("Int8Tensor", "Float8Tensor"):
        return f"torchao {name} weights are not a scheme fusepass runs (W8A8 int8 / fp8 with per-token activations)"
    kwargs = getattr(w, "act_quant_kwargs", None)
    if kwargs is None:
        return f"torchao {name} without activation quantization (weight-only) is not W8A8"
    N, K = w.qdata.shape
    if list(w.block_size) != [1, K]:
        return f"torchao {name} with block size {list(w.block_size)}: only per-row weight scales ([1, {K}])"
    if type(kwargs.granularity).__name__ != "PerRow":
        return f"torchao {name} with {kwargs.granularity} activations: only per-token (PerRow) activations"
    for attr in ("act_pre_scale", "act_quant_scale"):
        if getattr(w, attr, None) is not None:
            return f"torchao {name} with {attr} (pre-scaled or static activations) is not supported"
    if name == "Int8Tensor":
        if getattr(w, "reduce_range", False) or getattr(kwargs, "reduce_range", False):
            return "torchao Int8Tensor with reduce_range=True is not supported"
        if w.zero_point is not None and bool(w.zero_point.ne(0).any()):
            return "torchao Int8Tensor with asymmetric weights (a non-zero weight zero point) is not supported"
        kind = {"SYMMETRIC": "int8", "ASYMMETRIC": "int8-asym"}.get(kwargs.mapping_type.name)
        if kind is None:
            return f"torchao Int8Tensor with {kwargs.mapping_type.name} activations is not supported"
        act = Act(kind)
    else:
        if kwargs.float8_dtype != torch.float8_e4m3fn or w.qdata.dtype != torch.float8_e4m3fn:
            return f"torchao Float8Tensor of {w.qdata.dtype} / {kwargs.float8_dtype} activations: only float8_e4m3fn"
        if kwargs.hp_value_ub is not None:
            return "torchao Float8Tensor with an activation amax bound (hp_value_ub) is not supported"
        act = Act("fp8", floor=kwargs.hp_value_lb if kwargs.hp_value_lb is not None else 1e-12)
    return _Quantized(w.qdata.detach(), w.scale.detach().float().reshape(N), act)


# Formats prepare recognizes: each maps a linear's weight to its values, a reason, or None.
FORMATS = (_torchao,)


def _recognize(linear: nn.Linear) -> _Quantized | str | None:
    for fmt in FORMATS:
        found = fmt(linear.weight)
        if found is not None:
            return found
    return None


def _joint(members: list[tuple[str, nn.Linear, _Quantized]]) -> Joint:
    q = [m[2] for m in members]
    weight = torch.cat([x.weight for x in q]) if len(q) > 1 else q[0].weight.contiguous()
    colsum = weight.sum(1, dtype=torch.int32) if q[0].act.kind == "int8-asym" else None
    biases = [m[1].bias for m in members]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return Joint(weight, torch.cat([x.scale for x in q]), colsum, bias)


def prepare(model: nn.Module, join: bool = True) -> Preparation:
    """Convert, in place, every quantized ``nn.Linear`` of ``model`` that fusepass runs into a
    ``W8A8Linear`` (module docstring); returns what it did. ``join=False`` keeps each linear's
    weights in a buffer of its own (siblings then run as separate matmuls).

    Call it once, after quantizing (or loading) and before ``torch.compile``; the model then
    runs in eager too, on fusepass's ops."""
    report = Preparation()
    for parent_path, parent in list(model.named_modules()):
        # the children to convert, grouped by what one shared buffer needs in common
        groups: dict[tuple, list] = defaultdict(list)
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            found = _recognize(child)
            if isinstance(found, str):
                report.left[path] = found
                log.warning("fusepass.prepare: left %s as it is: %s", path, found)
            elif found is not None:
                bias = child.bias
                key = (found.act, found.weight.shape[1], found.weight.device,
                       None if bias is None else bias.dtype, name if not join else None)
                groups[key].append((name, child, found))
        for members in groups.values():
            joint = _joint(members)
            lo = 0
            for name, _, q in members:
                hi = lo + q.weight.shape[0]
                setattr(parent, name, W8A8Linear(joint, lo, hi, q.act))
                report.converted[f"{parent_path}.{name}" if parent_path else name] = q.act.kind
                lo = hi
            if len(members) > 1:
                report.joined.append([f"{parent_path}.{m[0]}" if parent_path else m[0] for m in members])
    log.info("%s", report)
    return report
