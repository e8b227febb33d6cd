"""A mixture of experts' quantized values read back from its checkpoint, for ``fusepass.prepare``.

A compressed-tensors W8A8 (int8) or FP8_DYNAMIC checkpoint stores each expert's linears apart
(``...layers.N.mlp.experts.<e>.gate_proj.weight`` int8 / fp8 and its per-channel
``weight_scale``; Mixtral's ``w1`` / ``w3`` / ``w2``). transformers (5.x) merges them into its
3-D experts and cannot keep them quantized: it loads them dequantized, ``q * scale`` in the
model's dtype, from which ``q`` does not come back exactly. So ``prepare`` reads ``q`` and the
scales from the checkpoint's files (``model.name_or_path``: a folder, or the Hugging Face cache,
offline), checks that they dequantize to exactly the module's weights (else the weights changed
after loading, and it leaves the module, saying so), and puts a ``W8A8Experts`` in its place.
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

from .experts import W8A8Experts, _refusal, fp8_experts, is_experts
from .formats.compressed_tensors import scheme_act
from .linear import Act

# the checkpoint's names of an expert's gate, up and down linears
PROJECTIONS = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
_LAYER = re.compile(r"^(.*?\.layers\.\d+\.)")


def ct_config(model: nn.Module):
    """The compressed-tensors ``QuantizationConfig`` ``model`` was loaded with, or None."""
    quantizer = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    config = getattr(compressor, "quantization_config", None)
    return config if type(config).__module__.startswith("compressed_tensors") else None


def _matches(name: str, targets) -> bool:
    """A linear of the checkpoint named ``name`` is among compressed-tensors ``targets``
    (``Linear``, or ``re:`` patterns of names)."""
    return any(t == "Linear" or (t.startswith("re:") and re.match(t[3:], name)) or t == name for t in targets or ())


def scheme_of(config, name: str):
    """The ``QuantizationScheme`` of the checkpoint's linear ``name`` under ``config``, or None."""
    if _matches(name, config.ignore):
        return None
    for group in config.config_groups.values():
        if _matches(name, group.targets):
            return group
    return None


class Checkpoint:
    """The safetensors files of a model's checkpoint: where each tensor is, read on demand (each
    file opened once). Raises OSError where the folder holds none."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.where = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            path = os.path.join(folder, "model.safetensors")
            with safe_open(path, "pt") as f:
                self.where = {k: path for k in f.keys()}
        self._open: dict = {}
        self._safe_open = safe_open

    def get(self, key: str) -> torch.Tensor:
        path = self.where[key]
        if path not in self._open:
            self._open[path] = self._safe_open(path, "pt")
        return self._open[path].get_tensor(key)


def checkpoint_folder(model: nn.Module) -> str | None:
    """The local folder of ``model``'s checkpoint: ``name_or_path`` itself, or its snapshot in
    the Hugging Face cache (never a download)."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        revision = getattr(getattr(model, "config", None), "_commit_hash", None)  # (the revision it loaded)
        return snapshot_download(name, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001  (not in the cache: nothing to read)
        return None


def expert_keys(checkpoint: Checkpoint, module_name: str) -> dict[str, list[str]] | str:
    """{"gate" | "up" | "down": each expert's weight key, in expert order} of the experts module
    ``module_name`` (its layer's ``experts.<e>.<projection>.weight`` keys), or why none."""
    layer = _LAYER.match(module_name)
    if layer is None:
        return f"no layer index in its name {module_name!r} to find its experts in the checkpoint"
    names = {alias: part for part, aliases in PROJECTIONS.items() for alias in aliases}
    pattern = re.compile(re.escape(layer.group(1)) + r"(?:.*\.)?experts\.(\d+)\.(\w+)\.weight$")
    found: dict[str, dict[int, str]] = {part: {} for part in PROJECTIONS}
    for key in checkpoint.where:
        m = pattern.match(key)
        if m and m.group(2) in names:
            found[names[m.group(2)]][int(m.group(1))] = key
    if not all(found.values()):
        return f"no per-expert gate, up and down weights under {layer.group(1)} in the checkpoint"
    return {part: [keys[e] for e in sorted(keys)] for part, keys in found.items()}


def _stacked(checkpoint: Checkpoint, keys: list[str], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' [E, N, K] weights and [E, N] fp32 scales, as stored."""
    qs, scales = [], []
    for key in keys:
        q, s = checkpoint.get(key), checkpoint.get(key + "_scale")
        if q.dtype != dtype or s.numel() != q.shape[0]:
            raise ValueError(f"{key}: {q.dtype} {tuple(q.shape)} with a weight_scale of {tuple(s.shape)}, not "
                             f"{dtype} per output channel")
        qs.append(q)
        scales.append(s.float().reshape(-1))
    return torch.stack(qs).to(device), torch.stack(scales).to(device)


def _dequantizes_to(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``q * scale`` (fp32, then the weight's dtype: transformers' dequantization) is
    ``weight`` exactly, one expert at a time."""
    return all(torch.equal((q[e].float() * scale[e][:, None]).to(weight.dtype), weight[e].detach())
               for e in range(q.shape[0]))


def read_experts(model: nn.Module, name: str, module: nn.Module, config, checkpoint: Checkpoint) -> W8A8Experts | str:
    """The ``W8A8Experts`` of transformers' experts ``module`` (at ``name`` in ``model``) from
    its compressed-tensors checkpoint, or why not."""
    why = _refusal(module, "prepare")
    if why is not None:
        return why
    keys = expert_keys(checkpoint, name)
    if isinstance(keys, str):
        return keys
    schemes = {id(scheme_of(config, key[: -len(".weight")])) for part in keys.values() for key in part}
    scheme = scheme_of(config, keys["gate"][0][: -len(".weight")])
    if scheme is None or len(schemes) != 1:
        return "its experts are not all quantized by one compressed-tensors scheme"
    kind = scheme_act(scheme)
    if kind not in ("int8", "fp8"):
        return kind if kind not in Act.KINDS else f"{kind} experts are not supported (int8 and fp8 per channel only)"
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.int8
    device = module.gate_up_proj.device
    try:
        (gate, gs), (up, us), (down, ds) = (_stacked(checkpoint, keys[p], dtype, device) for p in ("gate", "up", "down"))
    except (ValueError, KeyError, OSError) as e:
        return f"the checkpoint's experts: {e}"
    gate_up, gate_up_scale = torch.cat([gate, up], 1), torch.cat([gs, us], 1)
    if gate_up.shape != module.gate_up_proj.shape or down.shape != module.down_proj.shape:
        return (f"the checkpoint's experts ({tuple(gate_up.shape)}, {tuple(down.shape)}) are not the module's "
                f"({tuple(module.gate_up_proj.shape)}, {tuple(module.down_proj.shape)})")
    if not (_dequantizes_to(gate_up, gate_up_scale, module.gate_up_proj) and _dequantizes_to(down, ds, module.down_proj)):
        return ("its weights are not the checkpoint's values times their scales (changed since loading?): "
                "prepare keeps the checkpoint's values, and would undo the change")
    return W8A8Experts(gate_up, gate_up_scale, down, ds, Act(kind), module.act_fn)


def prepare_experts(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Replace, in place, transformers' native FP8 experts (``experts.fp8_experts``) and the
    experts of a compressed-tensors checkpoint's model (module docstring) by ``W8A8Experts`` of
    the checkpoint's values. Returns ({path: what it became}, {path: why left}); both empty for
    a model with neither."""
    converted, left = {}, {}
    for name, module in list(model.named_modules()):  # transformers' native FP8 experts: the values in memory
        if not name:
            continue  # (an experts module passed itself has no parent to put the new one in)
        new = fp8_experts(module)
        if isinstance(new, W8A8Experts):
            _replace(model, name, new)
            converted[name] = f"experts {new.act.kind}"
        elif new is not None:
            left[name] = new
    config = ct_config(model)
    experts = [(n, m) for n, m in model.named_modules() if n and is_experts(m)] if config is not None else []
    if not experts:
        return converted, left
    folder = checkpoint_folder(model)
    if folder is None:
        return converted, {n: "its checkpoint's files are not on this machine (name_or_path: a folder, or the "
                              "Hugging Face cache): transformers loaded its experts dequantized" for n, _ in experts}
    try:
        checkpoint = Checkpoint(folder)
    except OSError as e:  # (no safetensors files: a .bin checkpoint, a partial snapshot)
        return converted, {**left, **{n: f"its checkpoint's safetensors files cannot be read at {folder}: {e}"
                                      for n, _ in experts}}
    for name, module in experts:
        new = read_experts(model, name, module, config, checkpoint)
        if isinstance(new, str):
            left[name] = new
            continue
        _replace(model, name, new)
        converted[name] = f"experts {new.act.kind}"
    return converted, left


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
