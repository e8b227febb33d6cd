"""torchao's W8A8 weights (tensor subclasses on an ``nn.Linear``): ``Int8Tensor`` with dynamic
per-token activations (``Int8DynamicActivationInt8WeightConfig``, symmetric or asymmetric
activations) and ``Float8Tensor`` with per-row scales and dynamic per-token e4m3 activations
(``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)."""

from __future__ import annotations

import torch
from torch import nn

from ..linear import Act
from .base import Format, Quantized


def _torchao(w) -> Quantized | str | None:
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
    return Quantized(w.qdata.detach(), w.scale.detach().float().reshape(N), act)


def _recognize(module: nn.Module) -> Quantized | str | None:
    return _torchao(getattr(module, "weight", None)) if isinstance(module, nn.Linear) else None


FORMAT = Format("torchao", _recognize)
