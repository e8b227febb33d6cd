"""``W8A8Experts``: a mixture of experts' weights in int8 or fp8, run on ``fusepass.scaled_grouped_mm``.

transformers (5.x) holds a MoE layer's experts as 3-D weights, ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], in a module called as ``experts(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])`` (Qwen3-MoE, Mixtral, OLMoE, ...). ``W8A8Experts`` takes that call: each
token's row quantized per token (the module's ``Act``), its k routed rows through the gate/up
weights of their experts (one grouped launch), ``act(gate) * up`` quantized per row, then the down
weights with each row's routing weight in the epilogue (a second launch, each row rounded once
to the model's dtype), and the k rows of a token added in fp32 (``add_rows``). The weights are
the experts' own, quantized per output channel, or, from a native FP8 checkpoint
(``fp8_experts``), per 128x128 block with activations per 1x128 group.

``quantize_experts(model, "int8" | "fp8")`` is the one call that turns a float MoE model's experts
into these (fusepass's own per-channel recipe; torchao has none for 3-D expert weights): what it
cannot take it leaves, with the reason in its report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels.policy import GROUPED_BLOCK_M, grouped_block_m
from ..ops.dynamic import quantize_rows
from ..ops.grouped import route_experts, scaled_grouped_mm
from ..ops.grouped_dynamic import scaled_grouped_mm_dynamic
from .linear import ACTS, FP8_MAX, Act, act_index, keeping_dtypes, quantize_input, row_recipe
from .replacing import replacing_loses

KINDS = ("int8", "fp8", "fp8-block")
_QMAX = {"int8": 127.0, "fp8": FP8_MAX}
_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_weight(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float weights per output channel (row of each expert): (q [E, N, K], scale [E, N]
    fp32), symmetric, ``scale = amax / 127`` (int8, rounded) or ``amax / 448`` (e4m3): the ops'
    per-row recipe (``ops.dynamic.quantize_rows``), the scale first, floored at fp32's tiniest;
    ``fp8-block``: per 128x128 block of each expert, scale [E, N / 128, K / 128] (DeepSeek-V3's,
    as a native FP8 checkpoint holds them; N and K multiples of 128)."""
    tiny = torch.finfo(torch.float32).tiny
    if kind == "fp8-block":
        E, N, K = w.shape
        blocks = w.detach().float().reshape(E, N // 128, 128, K // 128, 128)
        scale = blocks.abs().amax(dim=(2, 4)).clamp(min=tiny) / FP8_MAX
        q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(w.shape), scale
    q, scale = quantize_rows(w.detach().reshape(-1, w.shape[-1]), _DTYPE[kind], _QMAX[kind], tiny, floor_first=False)
    return q.reshape(w.shape), scale.reshape(w.shape[:-1])


class W8A8Experts(nn.Module):
    """The experts of one MoE layer in int8 / fp8 (module docstring). Buffers: ``gate_up`` [E, 2I, H],
    ``gate_up_scale`` [E, 2I], ``down`` [E, H, I], ``down_scale`` [E, H] (fp32); or, with the
    ``fp8-block`` act (transformers' native FP8 experts), the scales one per 128x128 block,
    [E, 2I / 128, H / 128] and [E, H / 128, I / 128], as the checkpoint stores them."""

    def __init__(self, gate_up, gate_up_scale, down, down_scale, act: Act, act_fn):
        super().__init__()
        self.register_buffer("gate_up", gate_up)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down", down)
        self.register_buffer("down_scale", down_scale)
        self.act_index = act_index(act)
        self.act_fn = act_fn
        self.num_experts, self.hidden_dim, self.intermediate_dim = down.shape

    @property
    def act(self) -> Act:
        return ACTS[self.act_index]

    def _apply(self, fn, recurse=True):
        """Device moves move the weights and scales; dtype casts (``.half()``, ``.to(dtype)``) leave them."""
        return super()._apply(keeping_dtypes(fn, (self.gate_up, self.gate_up_scale, self.down, self.down_scale)),
                              recurse)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        act, k = ACTS[self.act_index], top_k_index.shape[1]
        q, scale, _ = quantize_input(hidden_states, act)
        ids = top_k_index.reshape(-1)  # (each token's k routed rows read its one quantized row)
        # (the rows sorted by expert once for both matmuls where they take the sorted blocks; a symbolic
        # M takes the prefill blocks, and Dynamo could not trace the policy's symbolic compares)
        M = ids.shape[0]
        block_m = grouped_block_m(M, self.num_experts) if isinstance(M, int) else GROUPED_BLOCK_M
        rows, blocks = (None, None) if block_m is None else route_experts(ids, self.num_experts, block_m)
        h = scaled_grouped_mm(q, self.gate_up.transpose(1, 2), scale, _op_scale(self.gate_up_scale), ids,
                              hidden_states.dtype, sorted_rows=rows, block_experts=blocks)
        gate, up = h.chunk(2, dim=-1)
        down, down_scale, weights = self.down.transpose(1, 2), _op_scale(self.down_scale), top_k_weights.reshape(-1)
        if act.kind in ("int8", "fp8") and act.ceiling is None and is_silu(self.act_fn):
            # (SiLU-mul and quantization inside down's kernel up to 32 routed rows, in one kernel
            # before it above: ops/grouped_dynamic.py)
            divisor, floor = row_recipe(act)
            y = scaled_grouped_mm_dynamic(up, down, down_scale, ids, hidden_states.dtype, row_weights=weights,
                                          divisor=divisor, floor=floor, gate=gate, sorted_rows=rows,
                                          block_experts=blocks)
        else:
            q2, scale2, _ = quantize_input(self.act_fn(gate) * up, act)
            y = scaled_grouped_mm(q2, down, scale2, down_scale, ids, hidden_states.dtype, row_weights=weights,
                                  sorted_rows=rows, block_experts=blocks)
        # (each weighted row rounded once to the model's dtype, as transformers' experts round theirs
        # (twice): half the bytes of fp32 rows to write and read again at prefill)
        return add_rows(y, k)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"act={self.act.kind}")


def add_rows(y: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's k consecutive rows of ``y`` [T * k, H] added in fp32 and rounded once to
    ``y``'s dtype. Traced, as the k slices added in turn: Inductor makes that one pointwise kernel
    at about the read rate, where its reduction of ``view(T, k, H).sum(dim=1)`` read at a quarter
    of it (docs/PERFORMANCE.md, "Mixture of experts"). Eagerly, torch's sum: one kernel, which
    accumulates bf16 and fp16 in fp32."""
    rows = y.view(-1, k, y.shape[-1])
    if not torch.compiler.is_compiling():
        return rows.sum(dim=1)
    total = rows[:, 0].float()
    for j in range(1, k):
        total = total + rows[:, j].float()
    return total.to(y.dtype)


def is_silu(fn) -> bool:
    """``fn`` is SiLU itself (torch's module or function, transformers' ``SiLUActivation``), which
    the down kernel computes on its own (``ops.grouped_dynamic``): not a subclass, nor an
    instance whose forward was replaced."""
    if fn is torch.nn.functional.silu:
        return True
    cls = type(fn)
    plain = "forward" not in getattr(fn, "__dict__", {})
    return plain and (cls is nn.SiLU or (cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations"))


def _op_scale(scale: torch.Tensor) -> torch.Tensor:
    """A weight scale as the op takes it: per channel as stored; block scales [E, N/128, K/128]
    as their [E, K/128, N/128] transpose (the weights' own)."""
    return scale.transpose(1, 2) if scale.dim() == 3 else scale


def fp8_experts(module: nn.Module) -> "W8A8Experts | str | None":
    """transformers' native FP8 experts (``FP8Experts``: fp8 [E, N, K] weights, fp32
    ``*_scale_inv`` per 128x128 block, activations quantized per 1x128 group as they run) as a
    ``W8A8Experts`` of the same values, or why not; None for another module."""
    if type(module).__name__ != "FP8Experts" or not type(module).__module__.startswith("transformers."):
        return None
    lost = replacing_loses(module, "W8A8Experts", "prepare")
    if lost is not None:
        return lost
    wanted = {"has_gate": True, "has_bias": False, "activation_scheme": "dynamic", "swiglu_alpha": None,
              "swiglu_limit": None, "gate_softcap": None, "up_softcap": None}
    unsupported = [f"{flag}={getattr(module, flag)!r}" for flag, value in wanted.items()
                   if getattr(module, flag, value) != value]
    if tuple(getattr(module, "block_size", None) or ()) != (128, 128):
        unsupported.append(f"block_size={getattr(module, 'block_size', None)!r}")
    if unsupported:
        return (f"FP8Experts with {', '.join(unsupported)}: W8A8Experts runs gated experts with dynamic activations "
                "and 128x128 block scales, act(gate) * up")
    weights = (module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj, module.down_proj_scale_inv)
    for name, w in (("gate_up_proj", weights[0]), ("down_proj", weights[2])):
        if w.dtype != torch.float8_e4m3fn:
            return f"FP8Experts {name} of {w.dtype}: float8_e4m3fn weights only"
    hidden, width = weights[2].shape[1:]
    if hidden % 128 or width % 128:  # (activations by whole 1x128 groups; gate and up in blocks of their own)
        return (f"FP8Experts of hidden size {hidden} and width {width}: whole 128x128 blocks only (multiples of "
                "128)")
    for w, s in (weights[:2], weights[2:]):
        blocks = (w.shape[0], -(-w.shape[1] // 128), -(-w.shape[2] // 128))
        if s.dtype != torch.float32 or tuple(s.shape) != blocks:
            return (f"FP8Experts scales of {s.dtype} {tuple(s.shape)} for a {tuple(w.shape)} weight: fp32, one per "
                    f"128x128 block ({list(blocks)}) only")
    return W8A8Experts(*(t.detach() for t in weights), Act("fp8-block"), module.act_fn)


def _refusal(module: nn.Module, call: str = "quantize_experts") -> str | None:
    """Why transformers' experts ``module`` cannot become a W8A8Experts (in ``call``), or None:
    what replacing it would lose (a class of its own, hooks, a forward replaced on the instance),
    or what the grouped GEMMs do not compute."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return (f"a {cls.__module__}.{cls.__qualname__} (not one of transformers' experts classes): its behaviour "
                "would be lost")
    lost = replacing_loses(module, "W8A8Experts", call)
    if lost is not None:
        return lost
    flags = {"has_bias": False, "is_transposed": False, "has_gate": True, "has_post_expert_norm": False,
             "is_concatenated": True}
    for name, wanted in flags.items():
        if getattr(module, name, wanted) != wanted:
            return f"{name}={not wanted} experts are not supported (gated, concatenated [gate; up], no bias)"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        return f"a custom gate ({type(module).__name__}._apply_gate) is not supported: act(gate) * up only"
    if not all(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() == 3
               for n in ("gate_up_proj", "down_proj")):
        return "no 3-D float gate_up_proj / down_proj weights"
    if not getattr(module, "gate_up_proj").is_floating_point() or getattr(module, "gate_up_proj").element_size() == 1:
        return f"weights of {module.gate_up_proj.dtype}: a float model's experts only (a quantized checkpoint: prepare)"
    return None


def is_experts(module: nn.Module) -> bool:
    """transformers' experts modules: 3-D ``gate_up_proj`` / ``down_proj`` and an ``act_fn``."""
    return (hasattr(module, "act_fn") and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and getattr(module, "gate_up_proj").dim() == 3)


@dataclass
class ExpertsReport:
    """What ``quantize_experts`` did: the converted modules' names, and those left with why."""

    converted: list = field(default_factory=list)
    left: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fusepass.quantize_experts: {len(self.converted)} experts modules converted, "
                 f"{len(self.left)} left as they are"]
        lines += [f"  {name}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


def quantize_experts(model: nn.Module, kind: str = "int8") -> ExpertsReport:
    """Replace, in place, every transformers experts module of ``model`` (float weights) by a
    ``W8A8Experts``: weights per output channel, activations per token (``kind``: int8 or fp8
    e4m3), or ``fp8-block`` (weights per 128x128 block, activations per 1x128 group, as native
    FP8 checkpoints are), run on ``fusepass.scaled_grouped_mm``. Returns the report of what was converted and
    what was left, with why. The router, attention and dense linears are untouched (quantize
    them as usual, then ``fusepass.prepare``)."""
    if kind not in KINDS:
        raise ValueError(f"fusepass.quantize_experts: kind must be one of {', '.join(KINDS)}; got {kind!r}")
    report = ExpertsReport()
    for name, module in list(model.named_modules()):
        if not is_experts(module):
            continue
        why = _refusal(module)
        if why is None and kind == "fp8-block" and any(d % 128 for d in (*module.gate_up_proj.shape[1:],
                                                                           *module.down_proj.shape[1:])):
            why = (f"fp8-block needs experts of whole 128x128 blocks; gate_up_proj is "
                   f"{tuple(module.gate_up_proj.shape)}, down_proj {tuple(module.down_proj.shape)}")
        if why is not None:
            report.left[name] = why
            continue
        (gate_up, gs), (down, ds) = (quantize_weight(getattr(module, n), kind) for n in ("gate_up_proj", "down_proj"))
        new = W8A8Experts(gate_up, gs, down, ds, Act(kind), module.act_fn)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        report.converted.append(name)
    if report.converted and callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained = _refuse_to_save  # (its checkpoint would load back as random experts)
    return report


def _refuse_to_save(*args, **kwargs):
    raise NotImplementedError(
        "save_pretrained of a model whose experts fusepass.quantize_experts converted: no checkpoint format holds "
        "W8A8Experts yet, and from_pretrained would build float experts without their weights; save the float "
        "model, and call quantize_experts after loading it")
