"""How every fusepass op is registered, in one place: ``define(name, impl, fake)``.

- ``impl``: the implementation, for every device. It validates its arguments (``checks.py``),
  then on CPU (and meta) tensors computes the exact reference (``reference.py``) and on CUDA
  ones launches the Triton kernels (``fusepass.kernels``). Registered as a
  ``torch.library.triton_op``: traced, each launch becomes a node that Inductor compiles and
  launches from its own generated code.
- ``fake``: the same checks and the output's metadata, no arithmetic. Explicit for every op:
  the default fake runs the whole implementation on fake tensors (the CPU reference, or the
  launch's config choice), 6 ms a call, most of the pass's time on a 32-layer graph.
- No gradient: the operands are quantized values; a call that would need one raises at the
  forward (``fusepass.prepare``'s linears compute their input's gradient themselves).
- ``IMPLS``: the implementation each op's node is lowered to (``fusepass.passes.lower``).
- Eager calls from the Python wrappers (``fusepass.scaled_mm`` ...): ``call``, which skips the
  dispatcher where it may and repeats a checked call's launch (``eager.py``).
"""

from __future__ import annotations

import torch
from torch.library import triton_op

from .._compat import inductor_config, plain_dispatch
from ..kernels.launch import traced
from ..kernels.policy import NO_GRAPHS, SPLIT_OUTSIDE_GRAPHS, Graphs, traced_graphs
from . import eager
from .checks import check_out_dtype

# op overload -> its implementation (what fusepass.passes.lower traces in its place)
IMPLS: dict = {}


def define(name: str, impl, fake) -> None:
    """Register ``fusepass::<name>`` (its schema from ``impl``'s annotations)."""
    qualname = f"fusepass::{name}"
    triton_op(qualname, impl, mutates_args=())
    torch.library.register_fake(qualname, fake)
    IMPLS[getattr(torch.ops.fusepass, name).default] = impl

    def refuse(ctx, inputs, output):
        raise RuntimeError(
            f"fusepass.{name} has no gradient: its operands are quantized values. The input gradient of a frozen "
            "quantized linear is its dequantized weight's: fusepass.prepare(model) converts linears into "
            "fusepass.W8A8Linear, which computes it; or call the op under torch.no_grad()")
    torch.library.register_autograd(qualname, _no_backward, setup_context=refuse)


def _no_backward(ctx, *grads):  # (never reached: ``refuse`` raises first)
    raise RuntimeError("fusepass ops have no gradient")


def launch_graphs(t: torch.Tensor) -> Graphs:
    """Where the launches of an op call on ``t`` will run (``policy.decode_splits``): eagerly,
    as they are; traced, inside Inductor's CUDA graphs where its ``triton.cudagraphs`` option
    is on for this compile, or inside the caller's own (``policy.splitting_outside_graphs``)."""
    if not traced(t):
        return NO_GRAPHS
    return traced_graphs(inductor_config().triton.cudagraphs, SPLIT_OUTSIDE_GRAPHS.get())


def plain_eager(*args) -> bool:
    """True where a call may skip the dispatcher and run the implementation directly
    (``eager.call``): eager (not traced, no mode, no functorch transform), its tensors plain
    (not subclasses; its other arguments anything), none needing autograd. The dispatcher's
    Python custom-op path costs 25-30 us a call on the H200's host. Anything else goes through
    ``torch.ops.fusepass.*``, which also raises the autograd error."""
    if torch.compiler.is_compiling() or not plain_dispatch():
        return False
    grad = torch.is_grad_enabled()
    for t in args:
        if type(t) is torch.Tensor:
            if grad and t.requires_grad:
                return False
        elif isinstance(t, torch.Tensor):  # a subclass
            return False
    return True


def call(name: str, impl, args: tuple, out_dtype: torch.dtype | None = None, replay: bool = True,
         members: tuple = ()):
    """A Python wrapper's call of ``fusepass::<name>`` on ``args`` (``members``: the tensors of
    its list arguments): directly where ``plain_eager`` (``replay``: through ``eager.call``, which
    repeats a recorded launch), else through the dispatcher, after checking an ``out_dtype``
    argument (the dispatcher's own error is less clear)."""
    if plain_eager(*args, *members):
        return eager.call(impl, *args) if replay else impl(*args)
    if out_dtype is not None:
        check_out_dtype(f"fusepass.{name}", out_dtype)
    return getattr(torch.ops.fusepass, name)(*args)
