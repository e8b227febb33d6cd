"""Tensor parallelism: W8A8 linears sharded with ``parallelize_module``, compiled with fusepass.

Shard a model as torchtitan does, these styles on its quantized linears (the stock
``ColwiseParallel`` / ``RowwiseParallel`` on plain ones), then ``torch.compile(model,
backend="fusepass")`` on each rank (``examples/tp_llama.py`` does it all)::

    from fusepass.distributed import QuantColwiseParallel, QuantRowwiseParallel
    parallelize_module(model, mesh, {"layers.0.attention.wq": QuantColwiseParallel(),
                                     "layers.0.attention.wo": QuantRowwiseParallel(), ...})

**Where the pass sees the graph.** Dynamo traces the program on DTensors; AOTAutograd then
desugars DTensor: each op runs DTensor's sharding propagation on fake tensors and is recorded
as the op on the local shards, each redistribution as functional collectives
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, each
followed by ``wait_tensor``). Inductor, and the pass in it, get that graph: plain local ops on
local shapes, collectives in between. The pass fuses each matmul's epilogue as it would on
one device; a collective is not elementwise, so an epilogue ends where one stands. For every
quantized linear to fuse whole on every rank, that needs:

- a sharding rule for the matmul, so that DTensor runs it on the shards: DTensor has one for
  ``aten._scaled_mm``, none for ``aten._int_mm``; ``fusepass.ops.sharding`` adds it (and rules
  for the fusepass ops);
- no redistribution inside the epilogue. Column-wise, the per-channel tensors (weight scale,
  bias, zero-point column sums) are sharded on N like the weight (``QuantColwiseParallel``).
  Row-wise, the matmul gives a Partial(sum) accumulator; the scale multiplies and casts keep
  it Partial (DTensor knows them linear), but a replicated term added to it (bias, zero-point
  correction) would make DTensor all-reduce first, or split the term by dividing it by the
  world size: ``QuantRowwiseParallel`` makes those terms Partial (rank 0 holds the term, the
  others zeros: exact, added once), so the only all-reduce is the module's output's, after the
  fused op;
- nothing else: per-token activation scales of a row-wise linear (whose input is sharded on
  K) come from an all-reduce(max) of the ranks' maxima before the matmul, the same scale as
  on one process.

A row-wise linear as one of 2 ranks' pass gets it (``w2`` of the example's feed-forward, K =
256, this rank's K slice 128), and what the pass makes of it::

    amax_2 = aten.amax(abs_3, [1], True)                          # f32[8, 1], over this rank's K
    all_reduce = _c10d_functional.all_reduce(amax_2, 'max', '0')
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)        # the max over all of K
    ...                                                           # quantize: i8[8, 128]
    _int_mm_2 = aten._int_mm(convert_element_type_4, permute_2)   # i8[8, 128] x i8[128, 128]
    convert_element_type_5 = prims.convert_element_type(_int_mm_2, f32)
    mul_5 = aten.mul.Tensor(convert_element_type_5, div_5)        # * per-token scale [8, 1]
    mul_6 = aten.mul.Tensor(mul_5, arg12_1)                       # * per-channel scale [1, 128]
    view_8 = aten.view(mul_6, [1, 8, -1])                         # this rank's part of the sum
    all_reduce_1 = _c10d_functional.all_reduce(view_8, 'sum', '0')
    wait_tensor_1 = _c10d_functional.wait_tensor(all_reduce_1)
    # after the pass:
    scaled_mm_default_2 = fusepass.scaled_mm(convert_element_type_4, permute_2,
                                             reshape_default_4, reshape_default_5, f32, None)
    view_default_2 = aten.view(scaled_mm_default_2, [1, 8, -1])
    all_reduce_1 = _c10d_functional.all_reduce(view_default_2, 'sum', '0')

**torchao-quantized linears** (an ``nn.Linear`` whose weight ``quantize_`` made a torchao
tensor subclass) take ``TorchaoColwiseParallel`` / ``TorchaoRowwiseParallel``. DTensor then
shards at the ``mm`` (its own rules), and torchao's subclass runs on each rank's shard, so
the graph holds torchao's usual local epilogue, which the pass fuses as on one device. A
row-wise linear's activation is quantized per token over this rank's K slice (torchao
quantizes inside its ``mm``, past DTensor), so its scales are not the 1-process model's:
a different rounding, no less accurate. torchao's fp8 (``Float8Tensor``) supports this,
without a bias (on DTensors ``F.linear`` with a bias runs ``aten.addmm``, which torchao
0.18's ``Float8Tensor`` lacks); its int8 ``Int8DynamicActivationInt8WeightConfig`` tensors
do not (``DTensor.from_local`` needs ``aten.view``, which torchao 0.18's ``Int8Tensor``
lacks). Both styles refuse these with an error.

Not yet: plain-PyTorch fp8 (``torch._scaled_mm`` in the model). DTensor's own
``aten._scaled_mm`` rule has no K split with per-token scales, so it gathers a row-wise fp8
linear's operands and runs it replicated (gloo cannot gather fp8 at all). With torch 2.11,
a row-wise linear with a zero point (``int8-asym``) stays unfused: its DTensor follows the
replicated operand of ``azp * colsum``, all-reduces the Partial ``colsum`` and splits the
product again by dividing it by the world size, in fp32.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .ops import sharding  # noqa: F401  the rules for aten._int_mm and the fusepass ops


def _tensors(module: nn.Module):
    """The module's own parameters and buffers (not its children's), by name."""
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)


def _register(module: nn.Module, name: str, old: torch.Tensor, new: DTensor) -> None:
    if isinstance(old, nn.Parameter):
        module.register_parameter(name, nn.Parameter(new, requires_grad=old.requires_grad))
    else:
        module.register_buffer(name, new)


def _weight(module: nn.Module, weight: str) -> torch.Tensor:
    w = getattr(module, weight, None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"{type(module).__name__}: no 2-D weight `{weight}` [N, K] to shard "
                         f"(pass weight=NAME to the style); its tensors: {[n for n, _ in _tensors(module)]}")
    return w


def _one_dim(style, mesh) -> None:
    """Refuse a mesh of more than one dimension: the styles' rank arithmetic (which rank holds
    a Partial term, which slice) is over the tensor-parallel mesh alone."""
    if mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__} needs a 1-D mesh, got a {mesh.ndim}-D one")


def _apply(style, module: nn.Module, mesh, partition) -> nn.Module:
    return distribute_module(
        module, mesh, partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class QuantColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a quantized linear that keeps its weight [N, K] as ``weight``
    (a buffer or parameter; ``"wq"`` in ``fusepass/demo/handwritten.py``): the weight is
    sharded on N, and so is every other tensor of the module with N elements along its
    last axis (per-channel scale [1, N] or [N], bias, zero-point column sums); tensors of
    one element (per-tensor scales) are replicated. Input replicated, output sharded on the
    last dim, as ``ColwiseParallel``. The shape decides: a per-input-channel tensor [K] (a
    SmoothQuant factor) is refused where K != N, but where K == N it would be taken for a
    per-channel one, so such modules are not supported."""

    def __init__(self, *, weight: str = "wq", **kwargs):
        super().__init__(**kwargs)
        self.weight = weight

    def _partition(self, name, module, mesh):
        N = _weight(module, self.weight).shape[0]
        for tname, t in list(_tensors(module)):
            if tname == self.weight:
                placement = Shard(0)
            elif t.dim() >= 1 and t.shape[-1] == N and t.numel() == N:
                placement = Shard(t.dim() - 1)
            elif t.numel() == 1:
                placement = Replicate()
            else:
                raise ValueError(f"{name or type(module).__name__}: `{tname}` {tuple(t.shape)} is neither "
                                 f"per-channel (N = {N} elements) nor per-tensor; cannot shard it column-wise")
            new = distribute_tensor(t.detach(), mesh, [placement], src_data_rank=self.src_data_rank)
            _register(module, tname, t, new)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _apply(self, module, device_mesh, self._partition)


class QuantRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a quantized linear that keeps its weight [N, K] as ``weight``:
    the weight is sharded on K; the tensors named in ``partial_terms`` are terms added to the
    matmul's result (bias, zero-point column sums ``colsum``): the mesh's rank 0 keeps its copy
    and the others hold zeros, a Partial(sum) DTensor, so each is added once and the module's
    epilogue stays on the shards (see the module docstring); every other tensor is
    replicated. Input sharded on the last dim, output replicated (an all-reduce), as
    ``RowwiseParallel``. Needs a 1-D mesh (the tensor-parallel one)."""

    def __init__(self, *, weight: str = "wq", partial_terms: tuple[str, ...] = ("bias", "colsum"), **kwargs):
        super().__init__(**kwargs)
        self.weight, self.partial_terms = weight, tuple(partial_terms)

    def _partition(self, name, module, mesh):
        _weight(module, self.weight)
        for tname, t in list(_tensors(module)):
            if tname in self.partial_terms:
                _one_dim(self, mesh)
                local = t.detach() if mesh.get_local_rank() == 0 else torch.zeros_like(t)
                new = DTensor.from_local(local.to(mesh.device_type), mesh, [Partial("sum")], run_check=False)
            else:
                placement = Shard(1) if tname == self.weight else Replicate()
                new = distribute_tensor(t.detach(), mesh, [placement], src_data_rank=self.src_data_rank)
            _register(module, tname, t, new)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _apply(self, module, device_mesh, self._partition)


def _slice_linear(style, dim: int, module: nn.Module, mesh) -> None:
    """Shard an ``nn.Linear``'s weight on ``dim`` by slicing this rank's own copy: torchao's
    tensor subclasses implement ``aten.slice`` (torchao shards them so in its tensor-parallel
    tests), not the split or scatter of ``distribute_tensor``. (``parallelize_module`` gives
    a style no module path, so the errors name the module's class.)"""
    what = f"{type(style).__name__} ({type(module).__name__})"
    if style.src_data_rank is not None:
        raise ValueError(f"{what}: each rank slices its own copy of the quantized weight (a torchao tensor cannot "
                         "be scattered): build and quantize the same model on every rank and pass src_data_rank=None "
                         "to parallelize_module")
    _one_dim(style, mesh)
    if getattr(module, "bias", None) is not None:
        raise ValueError(f"{what}: a bias is not supported: on DTensors F.linear with a bias runs aten.addmm, which "
                         "torchao's quantized weights do not implement")
    w, rank, world = module.weight, mesh.get_local_rank(), mesh.size()
    size = w.shape[dim]
    n = size // world
    # A block-wise weight's slice must start on a block boundary, or its scales go wrong
    # silently; a block spanning the whole dim (per-row scales along K) has one scale there.
    block = (getattr(w, "block_size", None) or [1, 1])[dim]
    if size % world or (block != size and n % block):
        raise ValueError(f"{what}: weight {tuple(w.shape)} does not split in {world} equal parts along dim {dim}"
                         + (f" on its {block}-wide scale blocks" if block not in (1, size) else ""))
    # clone: torchao's slice is a view of the whole weight, which each rank would keep.
    local = w.detach().narrow(dim, rank * n, n).clone()
    try:
        new = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    except NotImplementedError as e:
        raise ValueError(f"{what}: DTensor cannot hold its {type(w).__name__} weight ({str(e).splitlines()[0][:200]}); "
                         "torchao's fp8 Float8Tensor can") from e
    _register(module, "weight", w, new)


class TorchaoColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for an ``nn.Linear`` quantized by torchao, without a bias: the
    weight sliced on N, each rank from its own copy (``src_data_rank=None``). See the module
    docstring."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _slice_linear(self, 0, module, device_mesh)


class TorchaoRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for an ``nn.Linear`` quantized by torchao, without a bias: the
    weight sliced on K, each rank from its own copy (``src_data_rank=None``)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _slice_linear(self, 1, module, device_mesh)
