"""Random W8A8 tensors for the pass tests (N != M so the axes cannot be confused)."""

import torch

M, K, N = 24, 64, 40


def g(seed=0):
    return torch.Generator().manual_seed(seed)


def i8(*shape, seed=0):
    return torch.randint(-128, 128, shape, generator=g(seed), dtype=torch.int8)


def f8(*shape, seed=0):
    return (torch.randn(shape, generator=g(seed)) * 2).to(torch.float8_e4m3fn)


def scale(*shape, seed=0, dtype=torch.float32):
    return (torch.rand(shape, generator=g(seed)) * 0.01 + 0.001).to(dtype)


def bias(n=N, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=g(seed)).to(dtype)
