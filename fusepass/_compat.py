"""What fusepass needs of torch's and Triton's private internals, beyond their public APIs.

Tested on torch 2.11 (CUDA 13.0, Triton 3.6: the GPU machines) and torch 2.13 (CPU, Triton's
interpreter: CI). Each use here has a plain fallback where the name is missing, so another
version runs correctly, if slower to compile.

``memoize_kernel_analysis``: Inductor reads which arguments a user-defined Triton kernel
writes by compiling the kernel to Triton IR and walking it
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``; named
``identify_mutated_tensors`` before torch 2.10), once per call site and without a cache. A
Llama-3-8B-size model has 4 to 7 fused GEMM call sites a layer, of a handful of distinct
signatures: the analysis of one signature holds for every site of it, since its result names
the kernel's formal arguments and the IR depends only on the values hashed into the key below
(what ``generate_ttir`` reads of each argument: a tensor's dtype, a symbolic size as a
placeholder, every other value as it is).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("fusepass.pass")

_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")


def _arg_key(value):
    """What the kernel's IR depends on of one argument (None: not hashable, do not memoize)."""
    import sympy

    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("symbolic",)
    dtype = getattr(value, "dtype", None) if not isinstance(value, (int, float, bool)) else None
    if isinstance(dtype, torch.dtype):  # a FakeTensor or Inductor's TensorBox
        return ("tensor", dtype)
    try:
        hash(value)
    except TypeError:
        return None
    return ("value", type(value).__name__, value)


def _memoized(analyse, kernels: frozenset):
    cache: dict = {}

    @functools.wraps(analyse)
    def wrapper(kernel, kwargs, tma_descriptor_metadata):
        fn = kernel if kernel in kernels else getattr(kernel, "fn", None)  # (an Autotuner's)
        keys = tuple((name, _arg_key(v)) for name, v in sorted(kwargs.items()))
        if fn not in kernels or tma_descriptor_metadata or any(k is None for _, k in keys):
            return analyse(kernel, kwargs, tma_descriptor_metadata)
        key = (fn, keys)
        if key not in cache:
            cache[key] = analyse(kernel, kwargs, tma_descriptor_metadata)
        found = cache[key]
        return list(found) if isinstance(found, list) else found

    wrapper.fusepass_kernels = kernels
    return wrapper


def memoize_kernel_analysis(kernels) -> bool:
    """Make Inductor's per-call-site analysis of the Triton kernels ``kernels`` (their
    ``JITFunction``s) run once per distinct signature. Idempotent; returns whether it is in
    place (False on a torch without the analysis named here: each site is analysed, as
    before)."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:
        return False
    kernels = frozenset(kernels)
    for name in _ANALYSES:
        analyse = getattr(wrap, name, None)
        if analyse is None:
            continue
        known = getattr(analyse, "fusepass_kernels", None)
        if known is not None and kernels <= known:
            return True
        original = getattr(analyse, "__wrapped__", analyse)
        setattr(wrap, name, _memoized(original, kernels | (known or frozenset())))
        return True
    log.debug("torch %s has none of %s: Inductor analyses every fused GEMM call site", torch.__version__, _ANALYSES)
    return False
