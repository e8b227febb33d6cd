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

What it converts (the checkpoint's quantized values and scales, never re-quantized):

- torchao ``Int8Tensor`` weights with dynamic per-token activations
  (``Int8DynamicActivationInt8WeightConfig``, symmetric or asymmetric activations);
- torchao ``Float8Tensor`` weights with per-row scales and dynamic per-token e4m3 activations
  (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``);
- compressed-tensors checkpoints as ``transformers``' ``from_pretrained`` loads them (before
  or after their first forward): int8 per-channel weights with dynamic per-token activations,
  symmetric ("W8A8") or asymmetric, fp8 per-channel weights with dynamic per-token
  activations ("FP8_DYNAMIC"), and fp8 128x128 weight blocks with dynamic 1x128 activation
  groups ("FP8_BLOCK", fusepass's block-wise op); the activation scales as compressed-tensors
  computes them (amax / 127.5, amax / 448). Its decompression hook and offload wrappers go.

- transformers' own FP8 modules as ``from_pretrained`` builds them: ``FP8Linear`` (native FP8,
  ``quant_method: "fp8"``: 128x128 blocks, or per-tensor with dynamic or static activations)
  and ``FbgemmFp8Linear`` (Meta's FBGEMM FP8: per-row weights, per-token activations with an
  amax bound); ``_fp8_linear``, ``_fbgemm_fp8_linear``. Neither then needs transformers'
  kernels (a hub download, DeepGEMM, fbgemm-gpu).

- fusepass's own checkpoints (``saved.py``: what ``save_pretrained`` writes of a prepared model),
  as ``from_pretrained`` loads them.

Anything else quantized (weight-only, per-group, static or pre-scaled activations, another
library's type) is left as it is, and the returned ``Preparation`` says why, by module; so is a
linear whose replacement would change what the model does (``_changed_behaviour``). What a
converted module keeps of the one it replaced (gradients, state dicts, device moves): the
``W8A8Linear`` docstring and ``docs/PREPARE.md``.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from . import saved
from .linear import BLOCK, Act, Joint, W8A8Linear, bad_input_scale

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
    """One linear's checkpoint values: weight (N, K), per-row scale (N,) fp32 (or per
    128x128 block, (N / 128, K / 128)), activations (``fp8-static``: by ``input_scale``)."""

    weight: torch.Tensor
    scale: torch.Tensor
    act: Act
    input_scale: torch.Tensor | None = None


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
        # (on the meta device there are no values to check: what loads into the converted module
        # later is its own state, a symmetric weight's values and scales)
        if w.zero_point is not None and not w.zero_point.is_meta and bool(w.zero_point.ne(0).any()):
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


def _describe_ct(scheme) -> str:
    def args(a, activations=False):
        if a is None:
            return "none"
        kind = f"{a.type}{a.num_bits}{'' if a.symmetric else ' asymmetric'} per {a.strategy}"
        return kind + (" " + ("dynamic" if a.dynamic is True else "static") if activations else "")
    return (f"compressed-tensors weights {args(scheme.weights)}, "
            f"activations {args(scheme.input_activations, activations=True)}")


def _ct_scheme(module: nn.Module):
    """A module's compressed-tensors ``QuantizationScheme``, or None."""
    scheme = getattr(module, "quantization_scheme", None)
    return scheme if type(scheme).__module__.startswith("compressed_tensors") else None


def _compressed_tensors(linear: nn.Linear) -> _Quantized | str | None:
    """A compressed-tensors linear's checkpoint values (as ``from_pretrained`` loads them: an
    int8 / fp8 weight and its ``weight_scale``; or after a first forward, the weight
    decompressed to ``q * scale``, from which ``q`` comes back exactly), or why not."""
    scheme = _ct_scheme(linear)
    if scheme is None:
        return None
    w, a, name = scheme.weights, scheme.input_activations, _describe_ct(scheme)
    if w is None or a is None or w.num_bits != 8 or a.num_bits != 8 or w.type != a.type:
        return f"{name}: not W8A8 (8-bit weights and activations of one type)"
    block = str(w.strategy) == "block"
    if block:  # DeepSeek-V3's recipe: FP8_BLOCK
        if (w.type != "float" or list(w.block_structure or ()) != [BLOCK, BLOCK] or str(a.strategy) != "group"
                or a.group_size != BLOCK or a.dynamic is not True or not (w.symmetric and a.symmetric)):
            return f"{name}: block-wise only as fp8 128x128 weight blocks with dynamic 1x128 activation groups"
        if linear.weight.shape[0] % BLOCK or linear.weight.shape[1] % BLOCK:
            return f"{name}: a {tuple(linear.weight.shape)} weight is not whole 128x128 blocks"
    elif str(w.strategy) != "channel" or not w.symmetric:
        return f"{name}: only symmetric per-channel or 128x128 block weight scales"
    elif str(a.strategy) != "token" or a.dynamic is not True:
        return f"{name}: only dynamic per-token activations"
    fp8 = w.type == "float"
    if fp8 and not a.symmetric:
        return f"{name}: fp8 activations with a zero point"
    weight, (N, K) = linear.weight.detach(), linear.weight.shape
    scale = linear.weight_scale.detach().float()
    shape = (N // BLOCK, K // BLOCK) if block else (N,)
    if scale.numel() != math.prod(shape):
        return f"{name}: weight_scale of shape {tuple(scale.shape)} for a {(N, K)} weight"
    scale = scale.reshape(shape)
    target = torch.float8_e4m3fn if fp8 else torch.int8
    if weight.dtype != target and not weight.is_meta:  # decompressed by a first forward: q * scale in the model's dtype
        spread = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1) if block else scale[:, None]
        q = weight.float() / spread
        q = q.clamp(-448.0, 448.0).to(target) if fp8 else q.round().clamp(-128, 127).to(target)
        if not torch.equal((q.float() * spread).to(weight.dtype), weight):
            return f"{name}: a {weight.dtype} weight that is not {target} values times weight_scale"
        weight = q
    kind = "fp8-block" if block else "fp8" if fp8 else "int8" if a.symmetric else "int8-asym"
    return _Quantized(weight, scale, Act(kind))


def _undo_compressed_tensors(model: nn.Module, left: list[nn.Module]) -> None:
    """What compressed-tensors puts on a loaded model that stops Dynamo: the hook that
    decompresses every weight at the first forward (its linears left as they are are
    decompressed now instead), and the offload wrappers that forward installs on every module
    (their data-pointer checks break the graph on every call)."""
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.offload.dispatch import remove_dispatch

    hook = getattr(model, "ct_decompress_hook", None)  # (ModelCompressor.compress_model's handle)
    if hook is not None:
        hook.remove()
        del model.ct_decompress_hook
    remove_dispatch(model)
    for module in left:
        status = getattr(module, "quantization_status", None)
        if getattr(status, "value", status) == "compressed":
            decompress_module(module)


def _stored(module) -> _Quantized | None:
    """A linear of a fusepass checkpoint as ``from_pretrained`` loaded it (``saved.py``)."""
    if not isinstance(module, saved.Stored):
        return None
    if module.weight.dtype != module.stored_dtype or module.weight_scale.dtype != torch.float32:
        return (f"a fusepass checkpoint's {module.act.kind} linear loaded as {module.weight.dtype} weights and "
                f"{module.weight_scale.dtype} scales (something replaced its tensors after loading)")
    if module.input_scale is not None and bad_input_scale(module.input_scale):
        return (f"a fusepass checkpoint's fp8-static linear with input_scale {bad_input_scale(module.input_scale)} "
                "(missing from the checkpoint, or not a positive finite value)")
    return _Quantized(module.weight.detach(), module.weight_scale.detach(), module.act,
                      None if module.input_scale is None else module.input_scale.detach())


# transformers' FP8 modules (its integrations finegrained_fp8.py, the "fp8" checkpoints, and
# fbgemm_fp8.py; 5.17 to 5.24): FP8Linear and FbgemmFp8Linear are taken apart, and the others
# quantized there are left with a reason.
_HF_FP8 = ("transformers.integrations.finegrained_fp8", "transformers.integrations.fbgemm_fp8")
_HF_FP8_LINEARS = ("FP8Linear", "FbgemmFp8Linear")
_FP8 = torch.float8_e4m3fn


def _transformers_fp8(module: nn.Module) -> _Quantized | str | None:
    """A transformers FP8 module's checkpoint values, or why not (any class of those modules, or
    a subclass of one, that prepare does not convert: a fusepass checkpoint could not hold it);
    None for another module."""
    cls = type(module)
    source = next((c for c in cls.__mro__ if c.__module__ in _HF_FP8), None)
    if source is None:
        return None
    name = source.__name__
    if source is not cls:
        return (f"a {cls.__module__}.{cls.__qualname__} (a subclass of transformers' {name}): its behaviour would "
                f"be lost; prepare converts transformers' {', '.join(_HF_FP8_LINEARS)} themselves")
    if name == "FP8Linear":
        return _fp8_linear(module)
    if name == "FbgemmFp8Linear":
        return _fbgemm_fp8_linear(module)
    if name in ("FP8Experts", "FbgemmFp8Llama4TextExperts"):
        return (f"transformers' {name} (a mixture of experts' weights): fusepass does not run MoE experts yet; "
                "they run on transformers' own kernels")
    return f"transformers' {name}: not a linear fusepass converts (FP8GroupedLinear's groups, FP8Embedding's lookup)"


def _fp8_linear(m) -> _Quantized | str:
    """transformers' ``FP8Linear`` (``quant_method: "fp8"``: Qwen3-*-FP8, DeepSeek-V3's format):
    an e4m3 ``weight`` (N, K) and fp32 ``weight_scale_inv``, the weight's multiplier despite its
    name: one per 128x128 block (``block_size`` [128, 128]: activations per 1x128 group, as
    compressed-tensors' FP8_BLOCK) or one for the tensor (``block_size`` None: activations per
    token, or by the checkpoint's ``activation_scale`` where ``activation_scheme`` is "static")."""
    w, s, what = m.weight, m.weight_scale_inv, "transformers' FP8Linear"
    if w.dtype == torch.int8:
        return f"{what} with FP4-packed weights (two e2m1 values a byte): fusepass runs 8-bit weights"
    if w.dtype != _FP8:
        return f"{what} with a {w.dtype} weight: fusepass runs float8_e4m3fn weights"
    if s.dtype != torch.float32:
        return (f"{what} with {s.dtype} weight scales (UE8M0: powers of two, whose recipe also rounds the "
                "activations' scales to powers of two): fusepass runs fp32 scales")
    scheme, block, (N, K) = m.activation_scheme, m.block_size, w.shape
    if scheme not in ("dynamic", "static"):
        return f"{what} with activation_scheme {scheme!r}: fusepass runs 'dynamic' and 'static'"
    if block is None:
        if s.numel() != 1:
            return f"{what} without a block size (per-tensor) but weight_scale_inv of shape {tuple(s.shape)}"
        scale = s.detach().reshape(1).expand(N).clone()  # (the one value, on every row)
        if scheme == "dynamic":
            return _Quantized(w.detach(), scale, Act("fp8"))
        a = m.activation_scale
        if bad_input_scale(a):
            return f"{what} with a static activation_scale of {bad_input_scale(a)}: one positive finite value expected"
        return _Quantized(w.detach(), scale, Act("fp8-static"), a.detach().float().reshape(()))
    if list(block) != [BLOCK, BLOCK]:
        return f"{what} with {list(block)} weight blocks: fusepass runs 128x128 blocks"
    if scheme == "static":
        return (f"{what} with a static activation scale and 128x128 weight blocks: fusepass runs static activation "
                "scales beside per-tensor weight scales")
    if N % BLOCK or K % BLOCK:
        return f"{what}: a {(N, K)} weight is not whole 128x128 blocks"
    if tuple(s.shape) != (N // BLOCK, K // BLOCK):
        return f"{what}: weight_scale_inv of shape {tuple(s.shape)} for a {(N, K)} weight in 128x128 blocks"
    return _Quantized(w.detach(), s.detach(), Act("fp8-block"))


# FBGEMM's quantize_fp8_per_row floors a row's amax at 1e-12
_FBGEMM_FLOOR = 1e-12


def _fbgemm_fp8_linear(m) -> _Quantized | str:
    """transformers' ``FbgemmFp8Linear`` (``quant_method: "fbgemm_fp8"``: Meta's FP8 releases):
    an e4m3 ``weight`` (N, K), ``weight_scale`` (N, 1) per row, activations per token with their
    amax at most ``input_scale_ub`` (the config's ``activation_scale_ub``)."""
    w, s, ub, what = m.weight, m.weight_scale, m.input_scale_ub, "transformers' FbgemmFp8Linear"
    if w.dtype != _FP8:
        return f"{what} with a {w.dtype} weight: fusepass runs float8_e4m3fn weights"
    N = w.shape[0]
    if s.numel() != N or not s.is_floating_point():
        return f"{what}: weight_scale {s.dtype} of shape {tuple(s.shape)} for {N} rows (one float scale a row expected)"
    if ub.is_meta or ub.numel() != 1:
        return f"{what}: input_scale_ub of shape {tuple(ub.shape)} on {ub.device} (prepare a loaded model)"
    bound = float(ub)
    if not (math.isfinite(bound) and bound > _FBGEMM_FLOOR):
        return (f"{what} with input_scale_ub {bound}: a positive bound expected (transformers sets it from the "
                "config's activation_scale_ub as it loads the model)")
    return _Quantized(w.detach(), s.detach().float().reshape(N), Act("fp8", floor=_FBGEMM_FLOOR, ceiling=bound))


# Formats prepare recognizes: each maps a linear to its values, a reason, or None.
FORMATS = (lambda linear: _torchao(getattr(linear, "weight", None)), _compressed_tensors, _stored,
           _transformers_fp8)


def _recognize(linear: nn.Linear) -> _Quantized | str | None:
    for fmt in FORMATS:
        found = fmt(linear)
        if found is not None:
            return found
    return None


def _changed_behaviour(linear: nn.Module) -> str | None:
    """Why replacing ``linear`` would change what the model does, or None: a subclass of
    nn.Linear (its own methods and attributes), hooks (they would not run on the new module), or
    a forward replaced on the instance by something other than the format prepare takes apart
    (compressed-tensors')."""
    cls = type(linear)
    if isinstance(linear, nn.Linear) and cls is not nn.Linear and cls.__module__ not in _HF_FP8:
        own = " and its own forward" if cls.forward is not nn.Linear.forward else ""
        return (f"a {cls.__module__}.{cls.__qualname__} (a subclass of nn.Linear{own}): its behaviour would be "
                "lost; prepare converts nn.Linear itself")
    hooks = [kind for kind, held in (("forward pre-hooks", linear._forward_pre_hooks), ("forward hooks", linear._forward_hooks),
                                     ("backward pre-hooks", linear._backward_pre_hooks),
                                     ("backward hooks", linear._backward_hooks)) if held]
    if hooks:
        return (f"it has {' and '.join(hooks)}, which the converted module would not run; register them after "
                "prepare, on the new module")
    if "forward" in linear.__dict__ and _ct_scheme(linear) is None:
        return ("its forward is replaced on the instance (an offload or dispatch hook, a wrapper), which the converted "
                "module would not run")
    return None


def _joint(members: list[tuple[str, nn.Linear, _Quantized]]) -> Joint:
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
    found_in = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            found = _recognize(m)
            found_in[m] = (_changed_behaviour(m) or found) if isinstance(found, _Quantized) else found
        elif isinstance(m, saved.Stored):
            found = _stored(m)
            found_in[m] = (_changed_behaviour(m) or found) if isinstance(found, _Quantized) else found
        elif (reason := _transformers_fp8(m)) is not None:  # (an MoE's experts, an embedding: a reason)
            found_in[m] = reason
    compressed = [m for m in found_in if _ct_scheme(m) is not None]
    if compressed:
        _undo_compressed_tensors(model, [m for m in compressed if isinstance(found_in[m], str)])
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
    if not report.converted and not report.left:  # (e.g. a native FP8 checkpoint transformers dequantized)
        log.warning("fusepass.prepare: found no quantized linear (a native FP8 checkpoint loaded where transformers "
                    "cannot run FP8, on a CPU, is dequantized to bf16 as it loads: docs/PREPARE.md)")
    if report.left:
        reasons = sorted(set(report.left.values()))
        log.warning("fusepass.prepare: left %d quantized linear%s as %s: %s", len(report.left),
                    "s" * (len(report.left) != 1), "they are" if len(report.left) != 1 else "it is", "; ".join(reasons))
    log.info("%s", report)
    return report
