"""Every private name of torch and Triton that fusepass uses, in one place.

Tested on torch 2.11 (CUDA 13.0, Triton 3.6: the GPU machines) and torch 2.13 (CPU, Triton's
interpreter: CI); ``TESTED`` says so, and ``import fusepass`` logs a warning once on a torch
outside that range (they may work: nothing here is probed by version). Public APIs are used
wherever they cover the need (``torch.compiler``, ``torch.library``,
``torch.fx.experimental.symbolic_shapes``); what remains:

- Inductor's hooks for a custom pass and its configuration (``CustomGraphPass``, the config
  module, ``compile_fx``, mode options, the virtualized ``V.choices``), and what ``explain``
  runs of it (its decompositions and joint-graph passes under ``aot_autograd``);
- tracing an op's implementation into a graph (``detect_fake_mode``, the Python dispatcher,
  ``is_fake``) and ``cond_op``, the ``cond`` that takes symbolic predicates untraced;
- the eager fast path's checks that no mode or transform is active (``plain_dispatch``) and
  the current CUDA stream's raw handle (``current_raw_stream``, for Triton's launcher);
- Triton's allocator slot (``triton_allocator_unset``);
- ``memoize_kernel_analysis`` (below);
- Dynamo's ``counters`` (the pass's counts, as Inductor's own passes keep theirs), backend
  registration, an op's ``schema``, and DTensor's spec class (the sharding rules' arguments);
- ``torch.compiler``'s export flag (``exporting``): torch 2.11's Dynamo answers True for
  ``torch.compiler.is_exporting()`` under ``torch.compile`` too.

``memoize_kernel_analysis``: Inductor reads which arguments a user-defined Triton kernel
writes by compiling the kernel to Triton IR and walking it
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``; named
``identify_mutated_tensors`` before torch 2.10), once per call site and without a cache. A
Llama-3-8B-size model has 4 to 7 fused GEMM call sites a layer, of a handful of distinct
signatures: the analysis of one signature holds for every site of it, since its result names
the kernel's formal arguments and the IR depends only on the values hashed into the key below
(what ``generate_ttir`` reads of each argument: a tensor's dtype, a symbolic size as a
placeholder, every other value as it is). H100, 8 layers of Llama-3-8B, int8: 64 analyses,
5.4 s of the compile, became 5, 1.1 s.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.utils import counters
from torch._guards import detect_fake_mode
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from torch._inductor.virtualized import V
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [  # (re-exported as they are)
    "CustomGraphPass", "InductorChoices", "OpOverload", "V", "counters", "detect_fake_mode",
    "enable_python_dispatcher", "get_hash_for_files", "is_fake", "is_traceable_wrapper_subclass",
    "stable_topological_sort",
]

log = logging.getLogger("fusepass")

TESTED = {"torch": ((2, 11), (2, 13)), "triton": ((3, 6), (3, 9))}


def _version(text: str) -> tuple:
    """(major, minor) of a version string ("2.11.0+cu130", "3.6rc1")."""
    import re

    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def untested_versions() -> list[str]:
    """``"torch 2.14.0"``-style names of the installed torch / Triton outside ``TESTED``."""
    import triton

    found = {"torch": torch.__version__, "triton": triton.__version__}
    return [f"{name} {v}" for name, v in found.items()
            if not TESTED[name][0] <= _version(v) <= TESTED[name][1]]


def warn_untested() -> None:
    untested = untested_versions()
    if untested:
        log.warning("fusepass is tested on torch %s-%s and Triton %s-%s; this is %s: it uses private "
                    "internals of both (fusepass/_compat.py), which may have changed",
                    *(".".join(map(str, v)) for v in (*TESTED["torch"], *TESTED["triton"])), " and ".join(untested))


def inductor_config():
    from torch._inductor import config

    return config


def compile_fx(gm, example_inputs, config_patches: dict):
    from torch._inductor.compile_fx import compile_fx as compile_

    return compile_(gm, example_inputs, config_patches=config_patches)


def mode_options(mode: str) -> dict:
    """Inductor's options of a ``torch.compile`` mode (``"reduce-overhead"``: CUDA graphs)."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def aot_capture(forward_compiler):
    """A backend that AOT-traces with Inductor's decompositions and joint-graph passes, as
    Inductor does, then hands the forward graph to ``forward_compiler(gm, example_inputs)``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    def compiler(gm, example_inputs):
        joint_graph_passes(gm)
        return forward_compiler(gm, example_inputs)

    return aot_autograd(fw_compiler=compiler, decompositions=inductor_decompositions())


def cond_op():
    """``cond`` as a higher-order op, which takes a symbolic predicate without Dynamo."""
    from torch._higher_order_ops.cond import cond_op as op

    return op


def plain_dispatch() -> bool:
    """No torch-dispatch or torch-function mode and no functorch transform is active."""
    return not (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack())


def current_raw_stream(index: int) -> int:
    """The raw handle of device ``index``'s current CUDA stream, as Triton's launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(index)


def triton_allocator_unset() -> bool:
    """Whether Triton has no allocator for this thread (its default raises at launch)."""
    from triton.runtime import _allocation

    return _allocation._allocator.get() is _allocation._NULL_ALLOCATOR


def dtensor_spec():
    """DTensor's spec class: what a sharding rule receives for a DTensor argument."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return DTensorSpec


def exporting() -> bool:
    """Whether ``torch.export`` is tracing: ``torch.compiler.is_exporting()``'s flag, read as a
    value (torch 2.11's Dynamo folds the call itself to True under ``torch.compile``; 2.13 reads
    the flag)."""
    return torch.compiler._is_exporting_flag


def schema(op):
    """An operator overload's schema (its arguments' names, mutability)."""
    return op._schema


def register_backend(fn, name: str) -> None:
    """Register a ``torch.compile`` backend by name, unless one of that name exists."""
    if name not in torch.compiler.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(fn, name=name)

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
        key = (kernel, keys)  # (an Autotuner adds its first config's values: its own entry)
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
        original = analyse.__wrapped__ if known is not None else analyse
        setattr(wrap, name, _memoized(original, kernels | (known or frozenset())))
        return True
    log.debug("torch %s has none of %s: Inductor analyses every fused GEMM call site", torch.__version__, _ANALYSES)
    return False
