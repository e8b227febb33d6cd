"""transformers' own FP8 modules as ``from_pretrained`` builds them: ``FP8Linear`` (native FP8,
``quant_method: "fp8"``: 128x128 blocks, or per-tensor with dynamic or static activations) and
``FbgemmFp8Linear`` (Meta's FBGEMM FP8: per-row weights, per-token activations with an amax
bound). Neither then needs transformers' kernels (a hub download, DeepGEMM, fbgemm-gpu). Its
other FP8 modules (MoE experts, grouped linears, embeddings) are left with a reason."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..linear import BLOCK, Act, bad_input_scale
from .base import Format, Quantized


# transformers' FP8 modules (its integrations finegrained_fp8.py, the "fp8" checkpoints, and
# fbgemm_fp8.py; 5.17 to 5.24): FP8Linear and FbgemmFp8Linear are taken apart, and the others
# quantized there are left with a reason.
_HF_FP8 = ("transformers.integrations.finegrained_fp8", "transformers.integrations.fbgemm_fp8")
_HF_FP8_LINEARS = ("FP8Linear", "FbgemmFp8Linear")
_FP8 = torch.float8_e4m3fn


def _transformers_fp8(module: nn.Module) -> Quantized | str | None:
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


def _fp8_linear(m) -> Quantized | str:
    """transformers' ``FP8Linear`` (``quant_method: "fp8"``: Qwen3-*-FP8, DeepSeek-V3's format):
    an e4m3 ``weight`` (N, K) and fp32 ``weight_scale_inv``, the weight's multiplier despite its
    name: one per 128x128 block (``block_size`` [128, 128]: activations per 1x128 group, as
    compressed-tensors' FP8_BLOCK) or one for the tensor (``block_size`` None: activations per
    token, or by the checkpoint's ``activation_scale`` where ``activation_scheme`` is "static")."""
    w, s, what = m.weight, m.weight_scale_inv, "transformers' FP8Linear"
    if w.dtype == torch.int8:
        return f"{what} with FP4-packed weights (two e2m1 values a byte): fusepass takes 8-bit weights"
    if w.dtype != _FP8:
        return f"{what} with a {w.dtype} weight: fusepass takes float8_e4m3fn weights"
    if s.dtype != torch.float32:
        return (f"{what} with {s.dtype} weight scales (UE8M0: powers of two, whose recipe also rounds the "
                "activations' scales to powers of two): fusepass takes fp32 scales")
    scheme, block, (N, K) = m.activation_scheme, m.block_size, w.shape
    if scheme not in ("dynamic", "static"):
        return f"{what} with activation_scheme {scheme!r}: fusepass takes 'dynamic' and 'static'"
    if block is None:
        if s.numel() != 1:
            return f"{what} without a block size (per-tensor) but weight_scale_inv of shape {tuple(s.shape)}"
        scale = s.detach().reshape(1).expand(N).clone()  # (the one value, on every row)
        if scheme == "dynamic":
            return Quantized(w.detach(), scale, Act("fp8"))
        a = m.activation_scale
        if bad_input_scale(a):
            return f"{what} with a static activation_scale of {bad_input_scale(a)}: one positive finite value expected"
        return Quantized(w.detach(), scale, Act("fp8-static"), a.detach().float().reshape(()))
    if list(block) != [BLOCK, BLOCK]:
        return f"{what} with {list(block)} weight blocks: fusepass takes 128x128 blocks"
    if scheme == "static":
        return (f"{what} with a static activation scale and 128x128 weight blocks: fusepass takes static activation "
                "scales beside per-tensor weight scales")
    if N % BLOCK or K % BLOCK:
        return f"{what}: a {(N, K)} weight is not whole 128x128 blocks"
    if tuple(s.shape) != (N // BLOCK, K // BLOCK):
        return f"{what}: weight_scale_inv of shape {tuple(s.shape)} for a {(N, K)} weight in 128x128 blocks"
    return Quantized(w.detach(), s.detach(), Act("fp8-block"))


# FBGEMM's quantize_fp8_per_row floors a row's amax at 1e-12
_FBGEMM_FLOOR = 1e-12


def _fbgemm_fp8_linear(m) -> Quantized | str:
    """transformers' ``FbgemmFp8Linear`` (``quant_method: "fbgemm_fp8"``: Meta's FP8 releases):
    an e4m3 ``weight`` (N, K), ``weight_scale`` (N, 1) per row, activations per token with their
    amax at most ``input_scale_ub`` (the config's ``activation_scale_ub``)."""
    w, s, ub, what = m.weight, m.weight_scale, m.input_scale_ub, "transformers' FbgemmFp8Linear"
    if w.dtype != _FP8:
        return f"{what} with a {w.dtype} weight: fusepass takes float8_e4m3fn weights"
    N = w.shape[0]
    if s.numel() != N or not s.is_floating_point():
        return f"{what}: weight_scale {s.dtype} of shape {tuple(s.shape)} for {N} rows (one float scale a row expected)"
    if ub.is_meta or ub.numel() != 1:
        return f"{what}: input_scale_ub of shape {tuple(ub.shape)} on {ub.device} (prepare a loaded model)"
    bound = float(ub)
    if not (math.isfinite(bound) and bound > _FBGEMM_FLOOR):
        return (f"{what} with input_scale_ub {bound}: a positive bound expected (transformers sets it from the "
                "config's activation_scale_ub as it loads the model)")
    return Quantized(w.detach(), s.detach().float().reshape(N), Act("fp8", floor=_FBGEMM_FLOOR, ceiling=bound))


FORMAT = Format("transformers-fp8", _transformers_fp8, owns_class=lambda module: type(module).__module__ in _HF_FP8)
