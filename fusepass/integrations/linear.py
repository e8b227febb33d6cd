"""``W8A8Linear``: a quantized linear held in plain tensors, whose forward calls fusepass's ops.

What ``fusepass.prepare`` turns a quantized model's linears into (``prepare.py``). The weights
stay the checkpoint's own int8 / fp8 values and scales; the activation is quantized per token
in the forward, as the source format prescribes (its ``Act``), then one ``fusepass.scaled_mm``
(or ``scaled_mm_azp``, ``scaled_mm_blockwise``) call does the matmul and its whole epilogue.
The forward runs in eager (the ops' CPU reference or CUDA kernels), and compiled as one
``fusepass::w8a8_linear`` node (below) that the pass expands into forms it fuses; other backends
(stock Inductor without the pass, ``aot_eager``) run the node as a call, the eager forward;
exported, the forms themselves.

Sibling linears of one parent module with the same input width and scheme (a Llama
attention's q/k/v/o, an MLP's gate/up) keep their weights in one ``Joint`` buffer each, rows
in the children's order; each child reads its row range. Eager, that is the same matmul as
before; compiled with ``backend="fusepass"``, calls on one activation whose ranges touch
become one matmul over the union (``fusepass/passes/join.py``): q/k/v are one launch of
N = 6144 at Llama-3-8B's size instead of three, two of which (k and v, 4 MB each) were too
small to reach the memory bandwidth alone.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .._compat import exporting
from ..kernels import policy
from ..kernels.blockwise import BLOCK  # (fp8-block: the group width, and the weight's block side)
from ..ops import blockwise as blockwise_op, dynamic as dynamic_op
from ..ops.blockwise import quantize_groups
from ..ops.checks import MAX_K_INT8, MAX_K_INT8_AZP
from ..ops.dynamic import quantize_rows
from ..passes.expand import EXPANSIONS

# float32's eps: torchao's floor for a per-token scale (an all-zero row quantizes to zeros)
SCALE_EPS = torch.finfo(torch.float32).eps
FP8_MAX = 448.0  # e4m3's largest value: an fp8 row's divisor


@dataclass(frozen=True)
class Act:
    """How the forward quantizes its input, per token (row of the flattened input):

    - ``int8``: symmetric, ``scale = amax / divisor`` (torchao and compressed-tensors divide
      by 127.5: the range [-128, 127] spans 255 steps);
    - ``int8-asym``: ``scale = (max(hi, 0) - min(lo, 0)) / 255`` and a zero point;
    - ``fp8``: e4m3, ``scale = amax / 448``, amax at least ``floor``;
    - ``fp8-block``: as ``fp8``, per 128-wide group of a row (DeepSeek-V3's recipe; the weight
      then has one scale per 128x128 block);
    - ``fp8-static``: e4m3 with one scale for every row, the checkpoint's calibrated
      ``input_scale`` (a tensor of the linear's, not of the recipe).

    ``ceiling`` (``fp8`` only): the amax at most this (FBGEMM's ``activation_scale_ub``: an
    outlier row keeps a scale that leaves its other values representable).
    """

    kind: str
    divisor: float = 127.5
    floor: float = SCALE_EPS
    ceiling: float | None = None

    KINDS = ("int8", "int8-asym", "fp8", "fp8-block", "fp8-static")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"Act.kind must be one of {self.KINDS}, got {self.kind!r}")
        if self.ceiling is not None and (self.kind != "fp8" or not self.ceiling > self.floor):
            raise ValueError(f"Act.ceiling bounds an fp8 row's amax and must exceed the floor ({self.floor}); "
                             f"got {self.ceiling!r} for {self.kind!r}")


def quantize_input(x: torch.Tensor, act: Act, input_scale: torch.Tensor | None = None):
    """``x`` (M, K) quantized per row: (q (M, K), scale (M, 1) fp32, zero point (M,) int32
    or None); for ``fp8-block`` per 128-wide group, scale (M, K / 128); for ``fp8-static`` by
    ``input_scale``, scale (1, 1). Computed in fp32 whatever ``x``'s dtype; int8 and fp8 rows by
    the ops' one recipe (``ops.dynamic.quantize_rows``), fp8-block groups by theirs
    (``ops.blockwise.quantize_groups``): the forms the pass finds and moves into the M = 1
    kernels."""
    if act.kind == "fp8-static":
        scale = input_scale.float().reshape(1, 1)
        return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale, None
    if act.kind == "fp8-block":
        return *quantize_groups(x, act.floor), None
    if act.kind == "int8-asym":
        xf = x.float()
        lo, hi = xf.aminmax(dim=-1, keepdim=True)
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # (the range holds 0: zero stays exact)
        scale = nan_if_infinite(((hi - lo) / 255).clamp(min=SCALE_EPS))
        zp = (-128 - (lo / scale).round()).clamp(-128, 127)
        q = ((xf / scale).round() + zp).clamp(-128, 127).to(torch.int8)
        return q, scale, zp.to(torch.int32).reshape(-1)
    if act.kind == "fp8":
        return *quantize_rows(x, torch.float8_e4m3fn, FP8_MAX, act.floor, ceiling=act.ceiling), None
    return *quantize_rows(x, torch.int8, *row_recipe(act)), None


def row_recipe(act: Act) -> tuple[float, float]:
    """(divisor, floor) of ``quantize_rows`` for a symmetric per-row act, ``int8`` or ``fp8`` (with
    no ceiling), in the order the dtype's own recipe takes them (``policy.floors_first``)."""
    return (FP8_MAX, act.floor) if act.kind == "fp8" else (act.divisor, SCALE_EPS)


def bad_input_scale(t: torch.Tensor | None) -> str | None:
    """What is wrong with an ``fp8-static`` activation scale (one positive finite value), or None
    (for a tensor on the meta device, whose value is not known yet)."""
    if t is None or t.numel() != 1 or not t.is_floating_point():
        return "None" if t is None else f"{t.dtype} of shape {tuple(t.shape)}"
    if t.is_meta:
        return None
    value = float(t.detach())
    return None if math.isfinite(value) and value > 0 else str(value)


def nan_if_infinite(scale: torch.Tensor) -> torch.Tensor:
    """An int8 row's scale, NaN where it is infinite (an infinity in the row): its values are
    then ``inf / inf`` and rounding NaN to int8 has no defined result (0 in eager, others
    compiled), so without it the row's outputs were NaN eagerly and +-inf compiled; with it
    they are NaN everywhere (``docs/OPS.md``). An fp8 row needs none: e4m3 holds the NaN."""
    return torch.where(scale.isinf(), float("nan"), scale)


# Every distinct Act of this process, once. A module holds its Act's index here, not the Act:
# Dynamo guards each value a forward reads, once per source, so ``self.act.kind`` is a guard
# per module and ``ACTS[self.act_index].kind`` one per distinct Act: the host's part of a step
# then matched bf16's (docs/PERFORMANCE.md, "Why the code is as it is": "Acts by index"). The slots are there from the
# start: Dynamo also guards the list's length, and a new Act filling a free slot must not
# recompile the models compiled before it (past the last slot the list grows, and they
# recompile once).
ACTS: list[Act | None] = [None] * 64


def act_index(act: Act) -> int:
    """``act``'s place in ACTS (taking a free slot if new)."""
    if act not in ACTS:
        if None in ACTS:
            ACTS[ACTS.index(None)] = act
        else:
            ACTS.append(act)
    return ACTS.index(act)


def keeping_dtypes(fn, kept):
    """``fn`` (a module's ``_apply`` function) that moves the tensors ``kept`` (quantized values,
    their scales) as it moves them but never casts them: ``.to(dtype)``, ``.half()``, ``.bfloat16()``
    convert floating tensors, an fp8 weight and fp32 scales among them, and would change what they hold."""
    ids = {id(t) for t in kept if t is not None}

    def keep_dtype(t):
        if id(t) in ids:  # (what fn makes of an empty tensor of t's: a cast not to make of t)
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if probe.dtype != t.dtype:
                return t.to(probe.device)
        return fn(t)
    return keep_dtype


class Joint(nn.Module):
    """The weights of one or more sibling linears, rows in order:
    ``weight`` (N, K) int8 / fp8, ``weight_scale`` (N,) fp32 (``fp8-block``: (N / 128, K / 128),
    one per 128x128 block), ``colsum`` (N,) int32 (the weight's row sums, for asymmetric
    activations), ``bias`` (N,) and ``input_scale`` (a 0-d fp32 tensor: ``fp8-static``'s
    activation scale, for a joint of one linear), each or None. The quantized values and scales
    are buffers; the bias is a Parameter (trainable as the biases it joins were: ``requires_grad``
    theirs).

    Its state is saved and loaded by the linears that read it, each its own rows
    (``W8A8Linear``): a state dict holds no tensor twice, and loads into a model whose siblings
    are joined otherwise (or not at all)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 colsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("colsum", colsum)
        self.register_buffer("input_scale", input_scale)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.register_parameter("bias", bias)

    def _apply(self, fn, recurse=True):
        """``fn`` applied to every tensor (``.to(device)``, ``to_empty``, ``share_memory``, ...),
        except that the quantized values and scales keep their dtypes: ``.to(dtype)``,
        ``.half()``, ``.bfloat16()`` convert floating tensors, an fp8 weight and fp32 scales
        among them, and would change what they hold. Only the bias follows."""
        kept = (self.weight, self.weight_scale, self.colsum, self.input_scale)
        return super()._apply(keeping_dtypes(fn, kept), recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # (each linear saves its rows)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # (each linear loads its rows; a key here is not of this format)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


class W8A8Linear(nn.Module):
    """Rows ``[lo, hi)`` of ``joint``, applied as a linear layer with activations quantized
    per token by ``act``.

    As an ``nn.Linear`` it has ``in_features``, ``out_features``, ``weight`` (its rows of the
    quantized values, (out_features, in_features) int8 / fp8), ``bias`` (its rows of the joint
    bias, or None) and ``weight_scale``; its state dict holds those three under those names
    (no tensor shared between siblings), and ``load_state_dict`` copies them into its rows.
    The gradient with respect to the input is that of the dequantized weight (the
    straight-through estimate of the activation's rounding), as for a frozen float linear."""

    def __init__(self, joint: Joint, lo: int, hi: int, act: Act):
        super().__init__()
        if (act.kind == "fp8-static") != (joint.input_scale is not None):
            raise ValueError(f"fusepass.W8A8Linear: an {act.kind} linear's joint "
                             f"{'needs' if act.kind == 'fp8-static' else 'has no use for'} an input_scale")
        if act.kind == "fp8-static" and bad_input_scale(joint.input_scale):
            raise ValueError(f"fusepass.W8A8Linear: an fp8-static input_scale must be one positive finite value; got "
                             f"{bad_input_scale(joint.input_scale)}")
        self.joint = joint  # (shared by the siblings: one graph input for all of them)
        self.lo, self.hi, self.act_index = lo, hi, act_index(act)
        self.in_features, self.out_features = joint.weight.shape[1], hi - lo

    @property
    def act(self) -> Act:
        return ACTS[self.act_index]

    @property
    def weight(self) -> torch.Tensor:
        """The quantized weight, (out_features, in_features): the joint's rows."""
        return self._own_rows(self.joint.weight)

    @property
    def weight_scale(self) -> torch.Tensor:
        """Per output row (out_features,) fp32, or per 128x128 block (``fp8-block``)."""
        return _scale_rows(self.joint.weight_scale, self.lo, self.hi, self.act.kind)

    @property
    def bias(self) -> torch.Tensor | None:
        """The joint bias's rows (a lone linear's: its own Parameter), or None."""
        return None if self.joint.bias is None else self._own_rows(self.joint.bias)

    @property
    def input_scale(self) -> torch.Tensor | None:
        """``fp8-static``'s activation scale (0-d fp32), or None."""
        return self.joint.input_scale

    def _own_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t if (self.lo, self.hi) == (0, t.shape[0]) else t[self.lo:self.hi]

    def __getstate__(self):  # pickled with the Act itself: another process has other ACTS
        state = dict(self.__dict__)
        state["act"] = ACTS[state.pop("act_index")]
        return state

    def __setstate__(self, state):
        state = dict(state)
        state["act_index"] = act_index(state.pop("act"))
        super().__setstate__(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in X_DTYPES:
            raise TypeError(f"fusepass.W8A8Linear: the input must be bfloat16, float16 or float32 (it is quantized "
                            f"per token); got {x.dtype}, shape {tuple(x.shape)}")
        j = self.joint
        args = (x, j.weight, j.weight_scale, j.colsum, j.bias, j.input_scale, self.lo, self.hi, self.act_index)
        if torch.is_grad_enabled() and (x.requires_grad or (j.bias is not None and j.bias.requires_grad)):
            return _WithGradient.apply(*args)
        return _forward(*args)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in STATE:
            t = getattr(self, name)
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Each tensor copied into this linear's rows of the joint, shape and dtype checked (a
        bias may come in another floating dtype); a joint still on the meta device is made
        first, on the device of what loads into it. The row sums follow the weight."""
        j, lo, hi = self.joint, self.lo, self.hi
        for name in STATE:
            key, mine = prefix + name, getattr(self, name)
            if mine is None:
                continue
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if name == "input_scale" and bad_input_scale(value):
                error_msgs.append(f"{key}: an fp8-static activation scale must be one positive finite value; got "
                                  f"{bad_input_scale(value)}")
                continue
            floating = name == "bias" and value.is_floating_point()
            if value.shape != mine.shape or not (floating or value.dtype == mine.dtype):
                error_msgs.append(f"size or dtype mismatch for {key}: copying {tuple(value.shape)} {value.dtype} "
                                  f"into {tuple(mine.shape)} {mine.dtype} (a fusepass.W8A8Linear's rows)")
                continue
            if getattr(j, name).is_meta:  # (built on the meta device: made where the values are)
                made = torch.empty_like(getattr(j, name), device=value.device)
                if name == "bias":
                    j.bias = nn.Parameter(made, requires_grad=j.bias.requires_grad)
                else:
                    j._buffers[name] = made
                mine = getattr(self, name)
            with torch.no_grad():
                mine.copy_(value)
                if name == "weight" and j.colsum is not None:
                    if j.colsum.is_meta:
                        j.colsum = torch.empty_like(j.colsum, device=value.device)
                    j.colsum[lo:hi] = value.sum(1, dtype=torch.int32)
        if strict:
            ours = {prefix + n for n in STATE}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours
                                   and not k.startswith(prefix + "joint."))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, act={self.act.kind}, "
                f"rows=[{self.lo}, {self.hi}) of {self.joint.weight.shape[0]}")


def _scale_rows(weight_scale: torch.Tensor, lo: int, hi: int, kind: str) -> torch.Tensor:
    """Rows [lo, hi)'s scales: per row, or (``fp8-block``) the blocks' rows."""
    return weight_scale[lo // BLOCK:hi // BLOCK] if kind == "fp8-block" else weight_scale[lo:hi]


def _spread(blocks: torch.Tensor) -> torch.Tensor:
    """One scale per 128x128 block, (N / 128, K / 128), as one per weight element (N, K)."""
    return blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# What a W8A8Linear's state dict holds (those it has: not None)
STATE = ("weight", "weight_scale", "bias", "input_scale")


def _forward(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, index):
    """Rows [lo, hi) of the joint applied to ``x``: traced as one ``fusepass::w8a8_linear`` node
    (exported, the ATen forms); eagerly, on fusepass's ops."""
    act = ACTS[index]
    if torch.compiler.is_compiling():
        args = (x, weight, weight_scale, colsum, bias, input_scale, lo, hi, act.kind, act.divisor, act.floor,
                act.ceiling)
        # (exported: the ATen forms, so a saved program needs no fusepass to load)
        if exporting():
            return _traced(*args, SOURCE)
        return torch.ops.fusepass.w8a8_linear(*args, SOURCE)
    return _on_ops(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, act)


def _on_ops(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, act: Act):
    """The forward on fusepass's ops (eager, and ``w8a8_linear`` run as a call)."""
    q, scale, zp, w = _operands(x, weight, lo, hi, act, input_scale)
    bias = None if bias is None else bias[lo:hi]
    if act.kind == "fp8-block":
        y = torch.ops.fusepass.scaled_mm_blockwise(q, w, scale, _scale_rows(weight_scale, lo, hi, act.kind).t(), x.dtype, bias)
    elif q.dtype == torch.int8 and q.shape[1] > (MAX_K_INT8 if zp is None else MAX_K_INT8_AZP):
        y = _split_k(q, w, scale, weight_scale[lo:hi], x.dtype, bias, zp)
    elif zp is None:
        y = torch.ops.fusepass.scaled_mm(q, w, scale, weight_scale[lo:hi], x.dtype, bias)
    else:
        y = torch.ops.fusepass.scaled_mm_azp(q, w, scale, weight_scale[lo:hi], x.dtype, colsum[lo:hi], zp, bias)
    return y.reshape(*x.shape[:-1], hi - lo)


def _split_k(q, w, scale, weight_scale, out_dtype, bias, zp):
    """The product over a K too long for one exact int32 sum (``MAX_K_INT8``, with a zero point
    ``MAX_K_INT8_AZP``): each run of K exact (its zero-point term from its own rows of the
    weight), the runs' scaled fp32 results added; then the bias, one rounding."""
    run = MAX_K_INT8 if zp is None else MAX_K_INT8_AZP
    y = None
    for k in range(0, q.shape[1], run):
        part = (q[:, k:k + run], w[k:k + run], scale, weight_scale, torch.float32)
        p = (torch.ops.fusepass.scaled_mm(*part) if zp is None else
             torch.ops.fusepass.scaled_mm_azp(*part, part[1].sum(0, dtype=torch.int32), zp))
        y = p if y is None else y + p
    return (y if bias is None else y + bias.float()).to(out_dtype)


class _WithGradient(torch.autograd.Function):
    """A prepared linear where its input (or bias) needs a gradient: the forward as without,
    and the gradient of a float linear with the dequantized weight (the quantization of the
    activation passed straight through, as quantization-aware training and adapters on frozen
    quantized bases take it). The weights are constants: no gradient."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, colsum, bias, input_scale, lo, hi, index):
        ctx.save_for_backward(weight, weight_scale)
        ctx.rows, ctx.index, ctx.x_dtype, ctx.bias_rows = (lo, hi), index, x.dtype, None if bias is None else bias.shape[0]
        return _forward(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, index)

    @staticmethod
    def backward(ctx, grad):
        weight, weight_scale = ctx.saved_tensors
        (lo, hi), kind = ctx.rows, ACTS[ctx.index].kind
        g = grad.reshape(-1, hi - lo)
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w, dtype = weight[lo:hi], ctx.x_dtype
            if kind == "fp8-block":
                grad_x = g.to(dtype) @ (w.float() * _spread(_scale_rows(weight_scale, lo, hi, kind))).to(dtype)
            else:
                grad_x = (g.float() * weight_scale[lo:hi]).to(dtype) @ w.to(dtype)
            grad_x = grad_x.reshape(*grad.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[4]:
            grad_bias = g.new_zeros(ctx.bias_rows)
            grad_bias[lo:hi] = g.sum(0)
        return grad_x, None, None, None, grad_bias, None, None, None, None


# What a compiler sees of a W8A8Linear: one node, ``fusepass::w8a8_linear``, for Dynamo and
# AOTAutograd to trace, where the forward's own ops were about 20 (the per-token quantization and
# the dequantized product below) against nn.Linear's 2: traced three times over (Dynamo's fake
# propagation, AOTAutograd's two passes), they made a 32-layer model's compile twice bf16's
# (docs/PERFORMANCE.md, "Compile time"). The pass's first step (``passes/expand.py``) replaces the
# node by those forms (``_traced``), the graph the patterns match, as if the forward had been
# traced; run as a call (another backend, eager), it is the forward on the ops. Not part of the
# ops' contract (``docs/OPS.md``): a way to trace, its schema free to change.
# ``source``: the hash of every file the forms come from (this one, the ops' quantization
# recipes and the policy they read). Inductor's and AOTAutograd's caches key the graph, which
# holds the node and not its forms: without it a second process would be served an older body's.
# (Under torch.export the forward traces those forms itself: no node.)
TRACED_FROM = (__file__, dynamic_op.__file__, blockwise_op.__file__, policy.__file__)
SOURCE = hashlib.sha256(b"".join(Path(f).read_bytes() for f in TRACED_FROM)).hexdigest()[:16]
_LIB = torch.library.Library("fusepass", "FRAGMENT")
_LIB.define("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? colsum, Tensor? bias, "
            "Tensor? input_scale, int lo, int hi, str kind, float divisor, float floor, float? ceiling, "
            "str source) -> Tensor")


def _operands(x, weight, lo, hi, act: Act, input_scale=None):
    """``x``'s rows quantized by ``act`` (q (M, K), its scale, zero point or None) and rows
    [lo, hi) of ``weight`` as (K, N), column-major: the forward's operands, eager or traced."""
    return *quantize_input(x.reshape(-1, x.shape[-1]), act, input_scale), weight[lo:hi].t()


def _traced(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, kind, divisor, floor, ceiling, source):
    """Rows [lo, hi) of the joint weight applied to ``x``, in plain ATen ops:

    - symmetric (``fp8-static`` too, its scale per-tensor): a float matmul of the
      dequantized operands (the pass's ``dequant_mm``), which an exported program computes as
      written (correct, without the fused kernels);
    - asymmetric: ``_int_mm`` and the zero-point correction with the stored row sums
      (``int_mm_azp_per_token``). As a float matmul the pass would sum the weight's columns in the
      graph, a second read of the weight on every call. An exported program on CUDA needs
      M > 16 for ``_int_mm`` there;
    - ``fp8-block``: activations over 128-wide groups, the weight's scales spread over its
      128x128 blocks (``dequant_mm_blockwise``).

    The pass turns each back into one op call with exact integer (or fp8) products, and
    ``passes/join.py`` joins siblings' calls on one activation."""
    q, scale, zp, w = _operands(x, weight, lo, hi, Act(kind, divisor, floor, ceiling), input_scale)
    if kind == "fp8-block":
        a = (q.float().unflatten(-1, (-1, BLOCK)) * scale.unsqueeze(-1)).flatten(-2)
        y = a @ (weight[lo:hi].float() * _spread(_scale_rows(weight_scale, lo, hi, kind))).t()  # (w's rows: one transpose)
    elif zp is None:
        y = (q.float() * scale) @ (w.float() * weight_scale[lo:hi])
    else:
        acc = torch._int_mm(q, w) - zp.unsqueeze(1) * colsum[lo:hi].unsqueeze(0)
        y = acc.float() * scale * weight_scale[lo:hi]
    y = y if bias is None else y + bias[lo:hi]
    return y.to(x.dtype).reshape(*x.shape[:-1], hi - lo)


def _as_call(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, kind, divisor, floor, ceiling, source):
    return _on_ops(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, Act(kind, divisor, floor, ceiling))


def _fake(x, weight, weight_scale, colsum, bias, input_scale, lo, hi, kind, divisor, floor, ceiling, source):
    return x.new_empty((*x.shape[:-1], hi - lo))


_LIB.impl("w8a8_linear", _as_call, "CompositeExplicitAutograd")
torch.library.register_fake("fusepass::w8a8_linear", _fake, lib=_LIB)
EXPANSIONS[torch.ops.fusepass.w8a8_linear.default] = _traced
