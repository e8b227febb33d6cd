"""fusepass's own checkpoints (``saved.py``: what ``save_pretrained`` writes of a prepared
model), as ``from_pretrained`` loads them: ``saved.Stored`` modules."""

from __future__ import annotations

import torch

from .. import saved
from ..linear import bad_input_scale
from .base import Format, Quantized


def _stored(module) -> Quantized | None:
    """A linear of a fusepass checkpoint as ``from_pretrained`` loaded it (``saved.py``)."""
    if not isinstance(module, saved.Stored):
        return None
    if module.weight.dtype != module.stored_dtype or module.weight_scale.dtype != torch.float32:
        return (f"a fusepass checkpoint's {module.act.kind} linear loaded as {module.weight.dtype} weights and "
                f"{module.weight_scale.dtype} scales (something replaced its tensors after loading)")
    if module.input_scale is not None and bad_input_scale(module.input_scale):
        return (f"a fusepass checkpoint's fp8-static linear with input_scale {bad_input_scale(module.input_scale)} "
                "(missing from the checkpoint, or not a positive finite value)")
    return Quantized(module.weight.detach(), module.weight_scale.detach(), module.act,
                      None if module.input_scale is None else module.input_scale.detach())


FORMAT = Format("fusepass", _stored)
