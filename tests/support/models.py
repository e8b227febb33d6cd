"""Small W8A8 models written the way users write them (plain torch, none of our ops)."""

import torch
from torch import nn


def quantize_rows(x, dtype):
    """Symmetric per-row quantization: (q, scale[..., 1])."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    s = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-8) / qmax
    q = x.float() / s
    q = q.round().clamp(-128, 127) if dtype == torch.int8 else q.clamp(-448, 448)
    return q.to(dtype), s


class W8A8Linear(nn.Module):
    """Per-token activations x per-channel weights, int8 (``_int_mm``) or fp8 (``_scaled_mm``);
    ``dtype=None`` is the unquantized float linear, the reference the others approximate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype=torch.int8):
        super().__init__()
        self.dtype = dtype
        if dtype is None:
            self.register_buffer("w", weight)
            self.register_buffer("bias", bias)
            return
        wq, ws = quantize_rows(weight, dtype)
        self.register_buffer("wq", wq)  # [N, K]
        self.register_buffer("ws", ws.t().contiguous())  # [1, N]
        self.register_buffer("bias", bias)

    def forward(self, x):
        if self.dtype is None:
            return torch.nn.functional.linear(x, self.w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        xq, xs = quantize_rows(x.reshape(-1, shape[-1]), self.dtype)
        if self.dtype == torch.int8:
            y = torch._int_mm(xq, self.wq.t()).float() * xs * self.ws
        else:
            y = torch._scaled_mm(xq, self.wq.t(), xs, self.ws, out_dtype=torch.float32)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], -1)


class MLP(nn.Module):
    """Two quantized linears around an activation: both must fuse."""

    def __init__(self, dim=64, hidden=96, dtype=torch.int8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1, w2 = torch.randn(hidden, dim, generator=g), torch.randn(dim, hidden, generator=g)
        self.up = W8A8Linear(w1 / dim**0.5, torch.randn(hidden, generator=g), dtype)
        self.down = W8A8Linear(w2 / hidden**0.5, None, dtype)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))
