"""``fusepass.prepare(model)``: a quantized model's linears as plain-tensor ``W8A8Linear``s,
once, before ``torch.compile``.

Why a step of its own: a torchao model's weights are tensor subclasses, and whatever the
backend does with them, Dynamo guards each one's metadata on every call (in Python:
``__tensor_flatten__`` per weight) and AOTAutograd takes each apart on every call unless the
backend rewrites the graph (which then keeps the AOTAutograd cache from serving it); a backend
cannot drop Dynamo's guards without editing them. Those costs grow with the number of quantized
weights: a decode step of 8 Llama-3-8B layers quantized by torchao int8 took 0.95 ms beyond its
GPU kernels' time in CUDA graphs and 6.27 ms in default mode (H100, the backend then flattening
the weights at compile time); prepared, 0.71 and 3.97 ms, against bf16's 0.60 and 2.12 ms.
Plain tensors are guarded as a bf16 model's are, in C++, and the caches hit. Converting in place also lets
siblings share one buffer (``linear.py``).

What it converts (the checkpoint's quantized values and scales, never re-quantized): the
formats of ``formats/``, one module each, tried in the order of ``formats.FORMATS``: torchao's
W8A8 weights, compressed-tensors checkpoints (W8A8, FP8_DYNAMIC, FP8_BLOCK), fusepass's own
checkpoints, and transformers' own FP8 modules (native FP8's ``FP8Linear``, FBGEMM FP8's
``FbgemmFp8Linear``). A new format is one more module and one more entry there. A mixture of
experts' compressed-tensors checkpoint, whose experts transformers loads dequantized, gets its
experts back from its files as ``W8A8Experts`` (``experts_checkpoint.py``).

Anything else quantized (weight-only, per-group, static or pre-scaled activations, another
library's type) is left as it is, and the returned ``Preparation`` says why, by module; so is a
linear whose replacement would change what the model does (``_changed_behaviour``). What a
converted module keeps of the one it replaced (gradients, state dicts, device moves): the
``W8A8Linear`` docstring and ``docs/PREPARE.md``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from . import saved
from .experts_checkpoint import prepare_experts
from .replacing import replacing_loses
from .formats import FORMATS, Format, Quantized
from .linear import Joint, W8A8Linear

log = logging.getLogger("fusepass.prepare")


@dataclass
class Preparation:
    """What ``prepare`` did, by module path: ``converted`` (path -> scheme), ``left``
    (path -> why not), ``joined`` (the groups of siblings that share one weight buffer); of a
    mixture of experts' quantized checkpoint, ``experts`` (path -> what they became) and
    ``experts_left`` (path -> why not: ``experts_checkpoint.py``)."""

    converted: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    joined: list[list[str]] = field(default_factory=list)
    experts: dict[str, str] = field(default_factory=dict)
    experts_left: dict[str, str] = field(default_factory=dict)

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
        if self.experts or self.experts_left:
            lines.append(f"  {len(self.experts)} experts modules converted, {len(self.experts_left)} left as they are")
            lines += [f"  experts {path}: {what}" for path, what in self.experts.items()]
            lines += [f"  left experts {path}: {why}" for path, why in self.experts_left.items()]
        return "\n".join(lines)


def _recognize(module: nn.Module) -> tuple[Format | None, Quantized | str | None]:
    """The first format (``FORMATS``) that knows ``module``, and what it found."""
    for fmt in FORMATS:
        found = fmt.recognize(module)
        if found is not None:
            return fmt, found
    return None, None


def _changed_behaviour(linear: nn.Module, fmt: Format) -> str | None:
    """Why replacing ``linear`` would change what the model does, or None: a subclass of
    nn.Linear (its own methods and attributes), hooks (they would not run on the new module), or
    a forward replaced on the instance, unless the class or forward is the format's own
    (``Format.owns_class``, ``owns_forward``: what prepare takes apart)."""
    cls = type(linear)
    if isinstance(linear, nn.Linear) and cls is not nn.Linear and not fmt.owns_class(linear):
        own = " and its own forward" if cls.forward is not nn.Linear.forward else ""
        return (f"a {cls.__module__}.{cls.__qualname__} (a subclass of nn.Linear{own}): its behaviour would be "
                "lost; prepare converts nn.Linear itself")
    return replacing_loses(linear, "the converted module", "prepare", fmt.owns_forward(linear))


def _joint(members: list[tuple[str, nn.Linear, Quantized]]) -> Joint:
    q = [m[2] for m in members]
    weight = torch.cat([x.weight for x in q]) if len(q) > 1 else q[0].weight.contiguous()
    colsum = weight.sum(1, dtype=torch.int32) if q[0].act.kind == "int8-asym" else None
    biases = [m[1].bias for m in members]
    if biases[0] is None:
        bias = None
    elif len(biases) == 1:
        bias = biases[0]  # (the linear's own Parameter)
    else:
        bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=biases[0].requires_grad)
    return Joint(weight, torch.cat([x.scale for x in q]), colsum, bias, q[0].input_scale)


ROOT = "(the model itself)"


def prepare(model: nn.Module, join: bool = True) -> Preparation:
    """Convert, in place, every quantized ``nn.Linear`` of ``model`` that fusepass runs into a
    ``W8A8Linear`` (module docstring); returns what it did. ``join=False`` keeps each linear's
    weights in a buffer of its own (siblings then run as separate matmuls).

    Call it once, after quantizing (or loading) and before ``torch.compile``; the model then
    runs in eager too, on fusepass's ops. A linear held in several places is converted once
    and replaced in each (alone in its buffer); one whose replacement would change what the
    model does (a subclass, hooks: ``_changed_behaviour``) is left, with the reason."""
    report = Preparation()
    # each linear read once (after a first forward, reading a compressed-tensors weight divides it)
    found_in, formats = {}, defaultdict(list)
    for m in model.modules():
        fmt, found = _recognize(m)
        if fmt is None:
            continue
        found_in[m] = (_changed_behaviour(m, fmt) or found) if isinstance(found, Quantized) else found
        formats[fmt].append(m)
    for fmt, modules in formats.items():
        if fmt.finish is not None:
            fmt.finish(model, [m for m in modules if isinstance(found_in[m], str)])
    # (after the formats' finish, which removes offload wrappers; before ``saved.attach``,
    # which drops the loading quantizer whose config this reads)
    report.experts, report.experts_left = prepare_experts(model)
    if found_in.get(model) is not None:
        report.left[ROOT] = (found_in[model] if isinstance(found_in[model], str) else
                             "the model is itself a quantized linear, and prepare replaces a model's linears "
                             "in their parents; pass a module that holds it (nn.Sequential(linear))")
    held = defaultdict(int)  # linear -> the number of places that hold it
    for parent in model.modules():
        for child in parent._modules.values():
            if child in found_in:
                held[child] += 1
    converted: dict[nn.Module, W8A8Linear] = {}
    for parent_path, parent in list(model.named_modules()):
        # the children to convert, grouped by what one shared buffer needs in common
        groups: dict[tuple, list] = defaultdict(list)
        queued, names = set(), list(parent._modules.items())
        for name, child in names:
            if child not in found_in:
                continue
            found = found_in[child]
            if isinstance(found, str):
                path = f"{parent_path}.{name}" if parent_path else name
                report.left[path] = found
                log.debug("fusepass.prepare: left %s as it is: %s", path, found)
            elif found is not None and child not in converted and child not in queued:
                queued.add(child)
                bias = child.bias
                # (a static activation scale is the linear's own: no sibling shares its quantized input)
                alone = not join or held[child] > 1 or found.act.kind == "fp8-static"
                key = (found.act, found.weight.shape[1], found.weight.device,
                       None if bias is None else (bias.dtype, bias.requires_grad), name if alone else None)
                groups[key].append((name, child, found))
        for members in groups.values():
            joint = _joint(members)
            lo = 0
            for _, child, q in members:
                hi = lo + q.weight.shape[0]
                converted[child] = W8A8Linear(joint, lo, hi, q.act)
                lo = hi
            if len(members) > 1:
                report.joined.append([f"{parent_path}.{m[0]}" if parent_path else m[0] for m in members])
        for name, child in names:  # (every name the converted linears are held under here)
            if child in converted:
                setattr(parent, name, converted[child])
                report.converted[f"{parent_path}.{name}" if parent_path else name] = converted[child].act.kind
    if report.converted:
        saved.attach(model, report.left)
    if report.experts:
        from .experts import _refuse_to_save

        model.save_pretrained = _refuse_to_save  # (no checkpoint format holds W8A8Experts yet)
    if not report.converted and not report.left and not report.experts:  # (e.g. a native FP8 checkpoint transformers dequantized)
        log.warning("fusepass.prepare: found no quantized linear (a native FP8 checkpoint loaded where transformers "
                    "cannot run FP8, on a CPU, is dequantized to bf16 as it loads: docs/PREPARE.md)")
    if report.left:
        reasons = sorted(set(report.left.values()))
        log.warning("fusepass.prepare: left %d quantized linear%s as %s: %s", len(report.left),
                    "s" * (len(report.left) != 1), "they are" if len(report.left) != 1 else "it is", "; ".join(reasons))
    log.info("%s", report)
    return report
