"""Eager launches of the fused kernels at a fraction of Triton's per-call host cost.

``kernel[grid](*args)`` binds and specializes every argument on every call (Triton's
``JITFunction.run``): 22-40 us a launch of ``scaled_mm_kernel``'s 19 arguments on the H200's
host, against 6-11 us for the compiled kernel's own launcher.
What Triton decides depends only on the facts it specializes a kernel on: each tensor's
dtype and 16-byte alignment, each other argument's value (an int's ==1, %16 and width;
None; a constexpr), the device. So:

- ``DirectLauncher`` keeps, per such facts, the ``CompiledKernel`` that Triton's first launch
  returned, and launches it through its own launcher (``compiled[grid](*args, stream=...)``,
  Triton's launch hooks included). Triton's compile options read from its knobs
  (``knobs.runtime.debug`` ...) are those of a kernel's first launch with given facts.
- ``Replay`` goes one step further for a whole op call (``fusepass.ops.eager``): recorded
  from the one launch of a first call, it repeats that launch for later calls whose
  arguments have the same facts, with their tensors, a new output and new scratch.
  ``CallReplay`` does the same for an op call that ran cuBLAS's GEMM instead of a kernel.

Compiled code never comes here: there Inductor launches the kernels itself (``wrap_triton``),
and under ``TRITON_INTERPRET=1`` the kernel is Python run on the data (``launcher``).

The split-K ticket counters (``scaled_mm.split_k_sum``) must be zero at launch; the last
program of each tile sets its ticket back to zero, so eager launches share one zeroed buffer
per stream (``split_scratch``) instead of a ``torch.zeros`` a call (8-14 us, and a memset).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.library import wrap_triton

from .._compat import current_raw_stream

# Entries per cache before it starts afresh: each (M, N, K) of an eager caller is one.
MAX_ENTRIES = 4096


def _three(grid: tuple) -> tuple:
    """A grid of all three axes, as a CompiledKernel takes it."""
    return (*grid, 1, 1)[:3]


def launch_compiled(entry: tuple, grid: tuple, args, device: int | None = None) -> None:
    """Launch ``entry`` = (CompiledKernel, its constexpr values) on the current stream of
    ``device`` (the current device's index where the caller has it at hand)."""
    compiled, constexprs = entry
    stream = current_raw_stream(torch.cuda.current_device() if device is None else device)
    compiled[grid](*args, *constexprs, stream=stream)


class DirectLauncher:
    """``launcher[grid](*args, **meta)``: as ``kernel[grid](*args, **meta)`` on CUDA tensors;
    returns the (CompiledKernel, constexprs) entry it launched, or None."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}  # specialization facts -> (CompiledKernel, constexpr values in order)

    def __getitem__(self, grid: tuple):
        grid = _three(grid)
        return lambda *args, **meta: self.run(grid, args, meta)

    def run(self, grid, args: tuple, meta: dict):
        if getattr(self.kernel, "pre_run_hooks", None):  # (a sanitizer's or profiler's, added later)
            self.kernel[grid](*args, **meta)
            return None
        key = (torch.cuda.current_device(),
               *[(v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor) else v for v in args],
               *meta.items())
        entry = self.compiled.get(key)
        if entry is None:
            return self._first(grid, args, meta, key)
        launch_compiled(entry, grid, args)
        return entry

    def _first(self, grid, args: tuple, meta: dict, key):
        """Triton's own launch (it compiles where needed); keep what it returned where the
        call names every other parameter in ``meta``."""
        compiled = self.kernel[grid](*args, **meta)
        rest = self.kernel.arg_names[len(args):]
        if not all(name in meta for name in rest) or getattr(self.kernel, "pre_run_hooks", None):
            return None
        if len(self.compiled) >= MAX_ENTRIES:
            self.compiled.clear()
        entry = self.compiled[key] = (compiled, tuple(meta[name] for name in rest))
        return entry


_LAUNCHERS: dict = {}  # id(kernel) -> its DirectLauncher (which holds the kernel)


def launcher(kernel, fake: bool):
    """What to launch ``kernel`` through: a ``wrap_triton`` node where traced, the kernel
    itself under the interpreter, else its ``DirectLauncher`` (never ``wrap_triton`` eagerly:
    outside a trace it dispatches through a higher-order op, 400 us a call, H200 host)."""
    if fake:
        return wrap_triton(kernel)
    if type(kernel).__name__ == "InterpretedFunction":
        return kernel
    direct = _LAUNCHERS.get(id(kernel))  # (hashing a JITFunction computes its source key: 2-3 us)
    if direct is None:
        direct = _LAUNCHERS[id(kernel)] = DirectLauncher(kernel)
    return direct


_SCRATCH: dict = {}  # (device, stream) -> {"tickets": int32 zeros, acc dtype: partial slices}
# Partial-slice buffers kept per stream up to this size; a larger one is made afresh per call.
MAX_KEPT_PARTIAL_BYTES = 64 << 20


def release_scratch() -> None:
    """Drop the split-K buffers kept for eager launches (``split_scratch``), e.g. before
    ``torch.cuda.empty_cache()``; the next split launch on a stream makes them again."""
    _SCRATCH.clear()


def split_scratch(split_k: int, tiles: int, M: int, N: int, acc_dtype: torch.dtype, device: torch.device):
    """``(partial, tickets)`` for an eager split-K launch on the current stream: room for the
    (split_k, M, N) slices (1-D: the kernel only offsets the pointer), and zeroed ticket
    counters for ``tiles`` tiles. Launches on one stream run one after another, so they
    share both (a torch.empty and a torch.zeros a call cost 3-6 and 8-14 us of host time,
    the zeros a memset launch too). Inside a stream capture both are made afresh (the memset
    is captured and replayed with the graph), so that no graph shares them with eager
    launches."""
    numel = split_k * M * N
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return (torch.empty((numel,), dtype=acc_dtype, device=device),
                torch.zeros((tiles,), dtype=torch.int32, device=device))
    index = device.index if device.index is not None else torch.cuda.current_device()
    kept = _SCRATCH.setdefault((index, current_raw_stream(index)), {})
    tickets = kept.get("tickets")
    if tickets is None or tickets.numel() < tiles:
        tickets = kept["tickets"] = torch.zeros((max(tiles, 1024),), dtype=torch.int32, device=device)
    partial = kept.get(acc_dtype)
    if partial is None or partial.numel() < numel:
        partial = torch.empty((numel,), dtype=acc_dtype, device=device)
        if numel * partial.element_size() <= MAX_KEPT_PARTIAL_BYTES:
            kept[acc_dtype] = partial
    return partial, tickets


# --- one op call's launch, recorded and repeated ------------------------------------------

_RECORDING: ContextVar = ContextVar("fusepass_recording", default=None)


def _slots(args, inputs: tuple, own: tuple = ()) -> tuple[list, list]:
    """``(template, [(argument position, index into inputs)])`` of a recorded call's ``args``:
    ints, None and other constants stay in the template; tensors are left out (a kept plan
    must not keep its first call's tensors alive) and put in per call. Tensors in ``own``
    (by identity) are the caller's to place. StopIteration: a tensor that is none of
    ``inputs`` (a copy or a view made for the call)."""
    template = [None if isinstance(v, torch.Tensor) else v for v in args]
    slots = [(pos, next(i for i, t in enumerate(inputs) if t is v)) for pos, v in enumerate(args)
             if isinstance(v, torch.Tensor) and not any(v is o for o in own)]
    return template, slots


def _position(args, t: torch.Tensor) -> int:
    return next(pos for pos, v in enumerate(args) if v is t)


class Replay:
    """The one launch of an eager op call, to repeat on arguments of the same facts (dtypes,
    shapes, strides, devices, alignment; ``fusepass.ops.eager`` keys them): the same kernel,
    grid and sizes, with the call's own tensors, a new output and new scratch.

    ``split``: the launch's split-K ``(partial, tickets)``, or None; the grid is (tiles,
    split_k), as both split kernels take it (``scaled_mm.split_k_sum``)."""

    def __init__(self, entry, grid, args, inputs: tuple, out, split: tuple | None, prepare=None):
        self.entry, self.grid, self.prepare = entry, _three(grid), prepare
        self.template, self.inputs = _slots(args, inputs, own=(out, *(split or ())))
        self.out_pos = _position(args, out)
        self.out = (tuple(out.shape), out.stride(), out.dtype)
        self.scratch = None  # (partial's position, tickets' position, split_scratch's arguments)
        if split is not None:
            partial, tickets = split
            spec = (self.grid[1], self.grid[0], out.shape[0], out.shape[1], partial.dtype)
            self.scratch = (_position(args, partial), _position(args, tickets), spec)

    def __call__(self, inputs: tuple) -> torch.Tensor:
        """Launch on ``inputs`` (the op's tensors; ``inputs[0]`` on the current device)."""
        if self.prepare is not None:
            self.prepare()
        device = inputs[0].device
        shape, stride, dtype = self.out
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        args = self.template.copy()
        for pos, i in self.inputs:
            args[pos] = inputs[i]
        args[self.out_pos] = out
        if self.scratch:
            partial_pos, tickets_pos, spec = self.scratch
            args[partial_pos], args[tickets_pos] = split_scratch(*spec, device)
        launch_compiled(self.entry, self.grid, args, device.index)
        return out


class CallReplay:
    """A recorded eager call ``fn(*args)`` that is not a Triton launch (cuBLAS's GEMM), to
    repeat on a later call's tensors: every tensor in ``args`` must be one of the op call's
    own (``StopIteration`` otherwise: a copy or a view made for the call)."""

    def __init__(self, fn, args: tuple, inputs: tuple):
        self.fn = fn
        self.template, self.inputs = _slots(args, inputs)

    def __call__(self, inputs: tuple) -> torch.Tensor:
        args = self.template.copy()
        for pos, i in self.inputs:
            args[pos] = inputs[i]
        return self.fn(*args)


@contextmanager
def recording(inputs: tuple):
    """Collects ``(Replay, output)`` for each launch ``record``-ed inside (``(None, output)``
    where one cannot be repeated: a launch Triton did not hand back, or of a copy of an
    input). ``inputs``: the op call's tensors, in order."""
    launches: list = []
    token = _RECORDING.set((inputs, launches))
    try:
        yield launches
    finally:
        _RECORDING.reset(token)


def record(entry, grid, args: tuple, out: torch.Tensor, split: tuple | None = None, prepare=None) -> None:
    """Note an eager launch for ``recording``: ``split`` is its split-K ``(partial, tickets)``
    or None; ``prepare`` runs before each repeat."""
    _note(lambda inputs: None if entry is None else Replay(entry, grid, args, inputs, out, split, prepare), out)


def record_call(fn, args: tuple, out: torch.Tensor) -> None:
    """Note an eager call ``out = fn(*args)`` for ``recording``, as ``record`` a launch."""
    _note(lambda inputs: CallReplay(fn, args, inputs), out)


def _note(make_replay, out: torch.Tensor) -> None:
    """Append ``(make_replay(the call's tensors), out)`` while ``recording``; ``(None, out)``
    where a tensor is none of the call's own (a contiguous copy)."""
    state = _RECORDING.get()
    if state is None:
        return
    inputs, launches = state
    try:
        replay = make_replay(inputs)
    except StopIteration:
        replay = None
    launches.append((replay, out))
