"""Launch policy: the thresholds and decisions that say which kernel, split and grouping a
fused GEMM takes, each computed from what it is given (no global read here). The launchers
(``launch.py``, ``blockwise_launch.py``, ``group_launch.py``) carry the decisions out; the
pass and the backend import them from here. The measured reasons are in
``docs/PERFORMANCE.md``.

Also what a tracer tells the launches it traces (context variables, set by the pass and the
backend): the graph's size symbols, and whether the caller captures the compiled code into
CUDA graphs of its own.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import triton
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

# Above this M, an fp8 product runs as cuBLAS's torch._scaled_mm where that call takes it
# (``launch.cublas_takes_fp8``), and the pass leaves fp8 matmuls to it (``PassConfig.fp8_max_m``):
# the kernel was the faster up to M = 64, cuBLAS above (docs/PERFORMANCE.md, "One linear at a time").
FP8_CUBLAS_ABOVE_M = 64

# The grouped kernel's member arguments: at most this many siblings share one launch.
MAX_MEMBERS = 4
# A mixture of experts' grouped matmul (``kernels/grouped.py``): up to this many rows, a program a
# row reading its expert's weight (decode: batch 1 with top-8 is 8 rows in 8 experts); above,
# the rows sorted into blocks of one expert, each block's weight tile read once. At 128 rows
# (batch 16, top-8) the blocks were already the faster (docs/PERFORMANCE.md, "Mixture of experts").
GROUPED_ROWS_MAX_M = 32
# Rows an expert on average up to which the sorted kernel takes its small blocks (few rows an
# expert: padding costs more than the larger tiles save); above, the prefill tiles.
GROUPED_SMALL_BLOCKS_MAX_ROWS = 16
# The sorted blocks' rows: small blocks, and the prefill tiles' (also a symbolic M's)
GROUPED_SMALL_BLOCK_M = 16
GROUPED_BLOCK_M = 64


@dataclass(frozen=True)
class GroupedTiles:
    """The tiles of one grouped launch: the row kernel (``rows``; ``block_m`` unused) or the
    sorted-block kernel."""

    rows: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        if self.rows:
            return f"rows {self.block_n}x{self.block_k} w{self.num_warps}"
        return f"blocks {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


def grouped_tiles(M, N, K, E, contiguous_k: bool = False, quantizing: bool = False) -> GroupedTiles:
    """The kernel and tiles of ``fusepass.scaled_grouped_mm`` at M rows, E experts of [K, N]
    (the H200 sweeps of Qwen3-30B-A3B's and OLMoE's experts: docs/PERFORMANCE.md, "Mixture of
    experts"); ``contiguous_k``: the row kernel reads rows of ``b.T`` (gemv.py's loop: 8 of them
    a program, 2 warps, a block that divides K where one of 512, 256 or 128 does); ``quantizing``:
    it also quantizes (and gates) its rows (``scaled_grouped_mm_dynamic``), which each program
    does for itself, so 32 of them a program. A symbolic M takes the prefill tiles. Tiles no
    wider than N and K need."""
    block_m = grouped_block_m(M, E)
    if block_m is None and contiguous_k:
        block_k = next((k for k in (512, 256, 128) if statically_known_true(K % k == 0)), 512)
        tiles = GroupedTiles(True, 1, 32 if quantizing else 8, block_k, 2, 3)
    elif block_m is None:
        tiles = GroupedTiles(True, 1, 32, 512 if K >= 2048 else 256, 4, 1)
    elif block_m == GROUPED_SMALL_BLOCK_M:
        tiles = GroupedTiles(False, block_m, 128, 256, 8, 3)
    else:  # (4 stages: int8 14% faster than 3 for Qwen3-30B-A3B's gate/up at 16384 rows, 6% for down)
        tiles = GroupedTiles(False, block_m, 256, 128, 8, 4)
    narrowest = 8 if tiles.rows else 16
    return GroupedTiles(tiles.rows, tiles.block_m, min(tiles.block_n, max(narrowest, triton.next_power_of_2(N))),
                        min(tiles.block_k, max(32, triton.next_power_of_2(K))), tiles.num_warps, tiles.num_stages)


def grouped_block_m(M, E) -> int | None:
    """The rows of a sorted block at M routed rows and E experts (``grouped_tiles``' ``block_m``):
    None where the row kernel runs instead (no route). One block size for every [K, N] of a
    layer, so that its gate/up and down may share one route (``ops.grouped.route_experts``). An
    int M in plain compares, which Dynamo traces (a module's forward asks it)."""
    if isinstance(M, int):
        if M <= GROUPED_ROWS_MAX_M:
            return None
        return GROUPED_SMALL_BLOCK_M if M <= GROUPED_SMALL_BLOCKS_MAX_ROWS * E else GROUPED_BLOCK_M
    if statically_known_true(M <= GROUPED_ROWS_MAX_M):
        return None
    small = is_concrete_int(M) and int(M) <= GROUPED_SMALL_BLOCKS_MAX_ROWS * E
    return GROUPED_SMALL_BLOCK_M if small else GROUPED_BLOCK_M


@dataclass(frozen=True)
class Graphs:
    """Where a traced launch will run: inside Inductor's CUDA graphs (its ``triton.cudagraphs``
    option, e.g. ``mode="reduce-overhead"``), or inside CUDA graphs its caller captures itself
    (``splitting_outside_graphs``; as vLLM and SGLang do). Eager launches: neither."""

    inductor: bool = False
    caller: bool = False


NO_GRAPHS = Graphs()


def traced_graphs(inductor_cudagraphs: bool, caller: bool) -> Graphs:
    """Where a compile's traced launches run: ``Graphs`` from Inductor's ``triton.cudagraphs``
    option for the compile and whether the caller captures (``PassConfig.split_k_outside_cuda_graphs``
    or ``SPLIT_OUTSIDE_GRAPHS``)."""
    return Graphs(inductor=bool(inductor_cudagraphs), caller=bool(caller))


def decode_splits(fake: bool, symbolic_m: bool, graphs: Graphs) -> bool:
    """Whether a decode launch may split K (the configs' ``split_decode``).

    Eagerly: yes. A warm-up outside a stream capture must compile the kernel the capture
    then launches (a Triton compile inside a capture can fail), and the counters come zeroed
    from the last launch on the stream (``direct.split_scratch``). Traced: where its launches
    run inside CUDA graphs (``graphs``); outside them each split costs a launch. In Inductor's
    graphs not for a symbolic M: its ``cond`` is control flow, which Inductor keeps out of its
    CUDA graphs (torch 2.13's graph partition)."""
    return not fake or graphs.caller or (graphs.inductor and not symbolic_m)


def floors_first(dtype: torch.dtype, floor_first: bool | None = None) -> bool:
    """Whether a per-token scale is ``max(amax, floor) / divisor`` (else ``max(amax / divisor,
    floor)``): ``floor_first``, or where None the dtype's own recipe (e4m3's; int8 divides first)."""
    return dtype == torch.float8_e4m3fn if floor_first is None else bool(floor_first)


def per_element(v: torch.Tensor | None) -> bool:
    """A scale (or zero point) with one value per row or column, not one for the tensor."""
    return v is not None and not statically_known_true(v.numel() == 1)


def launch_variant(b: torch.Tensor, scale_b: torch.Tensor, bias) -> tuple | None:
    """What every member of one grouped launch must share: the weight's strides (the kernel
    takes one pair), scale granularity and bias or none. None where a stride is symbolic."""
    strides = b.stride()
    if not all(map(is_concrete_int, strides)):
        return None
    return tuple(map(int, strides)), per_element(scale_b), bias is None


# Set by whoever traces the ops for code that its caller captures into CUDA graphs itself
# (the fusepass pass and backend, from ``PassConfig.split_k_outside_cuda_graphs``).
SPLIT_OUTSIDE_GRAPHS: ContextVar[bool] = ContextVar("fusepass_split_outside_graphs", default=False)


@contextlib.contextmanager
def splitting_outside_graphs(on: bool):
    """Traced decode launches split K outside Inductor's CUDA graphs too while this is on."""
    token = SPLIT_OUTSIDE_GRAPHS.set(on)
    try:
        yield
    finally:
        SPLIT_OUTSIDE_GRAPHS.reset(token)


# The size symbols of the graph being lowered (SymInts), set by fusepass.passes.lower while
# it traces an op. Each cond takes them as operands: Inductor compiles its branches as
# subgraphs, which can compute a size like s0*s1 (the rows of a reshaped 3-D activation)
# only from symbols passed in.
GRAPH_SYMBOLS: ContextVar[tuple] = ContextVar("fusepass_graph_symbols", default=())
