"""compressed-tensors checkpoints as ``transformers``' ``from_pretrained`` loads them (before or
after their first forward): int8 per-channel weights with dynamic per-token activations,
symmetric ("W8A8") or asymmetric, fp8 per-channel weights with dynamic per-token activations
("FP8_DYNAMIC"), and fp8 128x128 weight blocks with dynamic 1x128 activation groups ("FP8_BLOCK",
fusepass's block-wise op); the activation scales as compressed-tensors computes them (amax /
127.5, amax / 448). Its decompression hook and offload wrappers go (``finish``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..linear import BLOCK, Act
from .base import Format, Quantized


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


def scheme_act(scheme) -> str:
    """The ``Act`` kind of a compressed-tensors ``QuantizationScheme`` fusepass runs (int8,
    int8-asym, fp8, fp8-block), or why it runs none."""
    w, a, name = scheme.weights, scheme.input_activations, _describe_ct(scheme)
    if w is None or a is None or w.num_bits != 8 or a.num_bits != 8 or w.type != a.type:
        return f"{name}: not W8A8 (8-bit weights and activations of one type)"
    if str(w.strategy) == "block":  # DeepSeek-V3's recipe: FP8_BLOCK
        if (w.type != "float" or list(w.block_structure or ()) != [BLOCK, BLOCK] or str(a.strategy) != "group"
                or a.group_size != BLOCK or a.dynamic is not True or not (w.symmetric and a.symmetric)):
            return f"{name}: block-wise only as fp8 128x128 weight blocks with dynamic 1x128 activation groups"
        return "fp8-block"
    if str(w.strategy) != "channel" or not w.symmetric:
        return f"{name}: only symmetric per-channel or 128x128 block weight scales"
    if str(a.strategy) != "token" or a.dynamic is not True:
        return f"{name}: only dynamic per-token activations"
    if w.type == "float":
        return "fp8" if a.symmetric else f"{name}: fp8 activations with a zero point"
    return "int8" if a.symmetric else "int8-asym"


def _compressed_tensors(linear: nn.Module) -> Quantized | str | None:
    """A compressed-tensors linear's checkpoint values (as ``from_pretrained`` loads them: an
    int8 / fp8 weight and its ``weight_scale``; or after a first forward, the weight
    decompressed to ``q * scale``, from which ``q`` comes back exactly), or why not."""
    scheme = _ct_scheme(linear)
    if scheme is None or not isinstance(linear, nn.Linear):
        return None
    kind = scheme_act(scheme)
    if kind not in Act.KINDS:
        return kind
    block, fp8 = kind == "fp8-block", kind.startswith("fp8")
    name = _describe_ct(scheme)
    if block and (linear.weight.shape[0] % BLOCK or linear.weight.shape[1] % BLOCK):
        return f"{name}: a {tuple(linear.weight.shape)} weight is not whole 128x128 blocks"
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
    return Quantized(weight, scale, Act(kind))


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


FORMAT = Format("compressed-tensors", _compressed_tensors, owns_forward=lambda module: _ct_scheme(module) is not None,
                finish=_undo_compressed_tensors)
