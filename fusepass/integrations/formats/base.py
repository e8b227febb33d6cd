"""What every checkpoint format's module gives ``prepare``: one linear's values (``Quantized``),
and the ``Format`` a format module declares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..linear import Act


@dataclass
class Quantized:
    """One linear's checkpoint values: weight (N, K), per-row scale (N,) fp32 (or per
    128x128 block, (N / 128, K / 128)), activations (``fp8-static``: by ``input_scale``)."""

    weight: torch.Tensor
    scale: torch.Tensor
    act: Act
    input_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Format:
    """A checkpoint format ``prepare`` converts. ``recognize(module)``: the module's values
    (``Quantized``), why they cannot be converted (a str), or None for a module of another
    format. ``owns_class(module)`` / ``owns_forward(module)``: the module's class (a subclass of
    ``nn.Linear``) / the forward replaced on the instance is this format's own, which prepare
    takes apart (not a user's behaviour that replacing the module would lose). ``finish(model,
    left)``: run once where the model holds modules of this format (``left``: those left as
    they are), e.g. to remove the format's loading hooks."""

    name: str
    recognize: Callable[[nn.Module], "Quantized | str | None"]
    owns_class: Callable[[nn.Module], bool] = lambda module: False
    owns_forward: Callable[[nn.Module], bool] = lambda module: False
    finish: Callable | None = None
