"""A Llama-style decoder stack, and W8A8 linears written the way users write them.

The quantized linears are plain PyTorch (``torch._int_mm`` / ``torch._scaled_mm`` and the
dequantization arithmetic after them): nothing here calls fusepass. Linear shapes follow
vLLM's fused projections, so Llama-3-8B sizes give BENCHMARKS.md's (N, K): qkv (6144, 4096),
o (4096, 4096), gate_up (28672, 4096), down (4096, 14336).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = ("int8", "int8-azp", "fp8")


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    dim: int = 4096
    hidden: int = 14336
    heads: int = 32
    kv_heads: int = 8

    def check(self) -> None:
        """Raise ValueError for sizes the model (or int8 matmuls) cannot take."""
        if min(self.layers, self.dim, self.hidden, self.heads, self.kv_heads) < 1:
            raise ValueError("--layers, --dim, --hidden, --heads and --kv-heads must be >= 1")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"--dim ({self.dim}) must divide by --heads ({self.heads}), "
                             f"and --heads by --kv-heads ({self.kv_heads})")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"the head size dim/heads = {self.dim // self.heads} must be even (rotary embedding)")
        if self.dim % 16 or self.hidden % 16:
            raise ValueError(f"--dim ({self.dim}) and --hidden ({self.hidden}) must be multiples of 16 "
                             "(torch._int_mm's alignment)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


def _rotate(x, pos):
    """Rotary position embedding over the last dim of [B, H, S, D]."""
    d = x.shape[-1] // 2
    freq = 1.0 / (500000.0 ** (torch.arange(d, device=x.device, dtype=torch.float32) / d))
    ang = pos[:, None].float() * freq[None, :]  # [S, d]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        hd = s.dim // s.heads
        self.attn_norm, self.mlp_norm = RMSNorm(s.dim), RMSNorm(s.dim)
        self.qkv_proj = nn.Linear(s.dim, (s.heads + 2 * s.kv_heads) * hd, bias=False)
        self.o_proj = nn.Linear(s.dim, s.dim, bias=False)
        self.gate_up_proj = nn.Linear(s.dim, 2 * s.hidden, bias=False)
        self.down_proj = nn.Linear(s.hidden, s.dim, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        s, hd = self.s, self.s.dim // self.s.heads
        q, k, v = self.qkv_proj(self.attn_norm(x)).split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], -1)
        q, k, v = (t.reshape(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(S, device=x.device)
        q, k = _rotate(q, pos), _rotate(k, pos)
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, S, s.dim))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class Decoder(nn.Module):
    """Embedded tokens in, hidden states out: ``layers`` blocks and a final norm."""

    def __init__(self, s: Shape):
        super().__init__()
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.dim)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build(s: Shape, device, dtype=torch.bfloat16, seed: int = 0) -> Decoder:
    """Random weights, scaled like a trained model's (unit-variance activations)."""
    torch.manual_seed(seed)
    model = Decoder(s)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=m.in_features**-0.5)
    return model.to(device=device, dtype=dtype).eval()


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
        self.register_buffer("colsum", wq.sum(1, dtype=torch.int32).reshape(1, -1) if scheme == "int8-azp" else None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach())

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scheme == "int8":
            xs = x2.abs().amax(1, keepdim=True).float().clamp(min=1e-8) / 127
            xq = (x2 / xs).round().clamp(-128, 127).to(torch.int8)
            y = torch._int_mm(xq, self.wq.t()).float() * xs * self.ws
        elif self.scheme == "int8-azp":
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
