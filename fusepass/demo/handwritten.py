"""W8A8 linears written by hand in plain PyTorch: the forms users write without torchao.

``quantize(model, scheme)`` swaps every ``nn.Linear`` of a model for a ``QuantLinear``:
per-channel symmetric weights, per-token activations quantized on the fly (symmetric int8,
asymmetric int8 with a zero point, or fp8 e4m3), then ``torch._int_mm`` /
``torch._scaled_mm`` and the dequantization arithmetic after them. Nothing here calls
fusepass: this is what the pass has to recognize (``fusepass demo --quantizer handwritten``).
"""

from __future__ import annotations

import torch
from torch import nn

SCHEMES = ("int8", "int8-asym", "fp8")


class QuantLinear(nn.Module):
    """A W8A8 linear: per-channel symmetric weights, per-token activations quantized on
    the fly (symmetric int8, asymmetric int8 with a zero point, or fp8 e4m3)."""

    def __init__(self, linear: nn.Linear, scheme: str):
        super().__init__()
        self.scheme = scheme
        w = linear.weight.detach().float()  # [N, K]
        qmax = 448.0 if scheme == "fp8" else 127.0
        ws = w.abs().amax(1).clamp(min=1e-8) / qmax
        wq = w / ws[:, None]
        wq = wq.to(torch.float8_e4m3fn) if scheme == "fp8" else wq.round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("wq", wq)  # [N, K]
        self.register_buffer("ws", ws.reshape(1, -1))  # [1, N] fp32
        self.register_buffer("colsum", wq.sum(1, dtype=torch.int32).reshape(1, -1) if scheme == "int8-asym" else None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach())

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scheme == "int8":
            xs = x2.abs().amax(1, keepdim=True).float().clamp(min=1e-8) / 127
            xq = (x2 / xs).round().clamp(-128, 127).to(torch.int8)
            y = torch._int_mm(xq, self.wq.t()).float() * xs * self.ws
        elif self.scheme == "int8-asym":
            lo, hi = x2.aminmax(dim=1, keepdim=True)
            xs = (hi - lo).float().clamp(min=1e-8) / 255
            azp = (-128 - lo.float() / xs).round().to(torch.int32)
            xq = ((x2 / xs).round() + azp).clamp(-128, 127).to(torch.int8)
            acc = torch._int_mm(xq, self.wq.t()) - azp * self.colsum
            y = acc.float() * xs * self.ws
        else:
            xs = x2.abs().amax(1, keepdim=True).float().clamp(min=1e-8) / 448
            xq = (x2 / xs).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(xq, self.wq.t(), xs, self.ws, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.wq.shape[1]}, out_features={self.wq.shape[0]}, scheme={self.scheme}"


def quantize(model: nn.Module, scheme: str) -> nn.Module:
    """Replace every nn.Linear of ``model`` (in place) by a QuantLinear; returns it."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, QuantLinear(child, scheme))
        else:
            quantize(child, scheme)
    return model
