"""A prepared model saved with ``save_pretrained`` and loaded back with ``from_pretrained``.

The format (``quant_method: "fusepass"`` in the checkpoint's ``config.json``): each converted
linear's own tensors under its own names, as ``W8A8Linear``'s state dict holds them (``weight``
int8 / fp8 (N, K), ``weight_scale`` fp32 (N,) or one per 128x128 block, ``bias``,
``input_scale`` for a static activation scale), and ``quantization_config.schemes``: each
activation recipe (``Act``: kind, divisor, floor, and an amax ceiling where it has one) with
the paths of the linears that use it. Version 2 is version 1 with a ceiling or a static
activation scale, written only where a scheme has one (a fusepass that reads only version 1
refuses what it would misread). Nothing is re-quantized or rounded: the values and scales
load bit for bit, and ``prepare`` joins the siblings again.

``prepare`` writes that config into a transformers model's ``config`` where it converted every
quantized linear, so ``save_pretrained`` writes the format. ``from_pretrained`` reads it once
fusepass is imported (before or after transformers: ``register_when_imported``): the quantizer
(``hf.py``) puts a ``Stored`` module where each linear was, transformers loads the tensors into
them, and ``prepare`` converts them. Without fusepass, transformers skips the config it does not
know with a warning ("Unknown quantization type, got fusepass ... we will skip the
quantization") and loads the int8 values into float weights: import fusepass first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

import torch
from torch import nn

from .linear import BLOCK, Act, W8A8Linear

log = logging.getLogger("fusepass.prepare")

QUANT_METHOD = "fusepass"
VERSION = 2
VERSIONS = (1, 2)  # (what this fusepass reads)
_TRANSFORMERS_REGISTRY = "transformers.quantizers"  # (its __init__ imports the registry, auto.py)


class Stored(nn.Module):
    """A converted linear as ``from_pretrained`` loads it, before ``prepare`` joins it with its
    siblings: the checkpoint's tensors as Parameters of the dtypes they were saved in (so the
    loader neither casts nor rounds them)."""

    def __init__(self, in_features: int, out_features: int, act: Act, bias: torch.Tensor | None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.act = in_features, out_features, act
        self.stored_dtype = dtype = torch.float8_e4m3fn if act.kind.startswith("fp8") else torch.int8
        scale = (out_features // BLOCK, in_features // BLOCK) if act.kind == "fp8-block" else (out_features,)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(scale, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(torch.empty_like(bias, device=device))
        # (NaN until loaded: a checkpoint without it is refused by prepare, not run on uninitialized memory)
        self.input_scale = (nn.Parameter(torch.full((), float("nan"), dtype=torch.float32, device=device),
                                         requires_grad=False)
                            if act.kind == "fp8-static" else None)

    def forward(self, x):
        raise RuntimeError("fusepass: a stored W8A8 linear runs once fusepass.prepare(model) has converted it "
                           "(from_pretrained does so when it loads a fusepass checkpoint)")


def describe(model: nn.Module) -> dict:
    """The ``quantization_config`` of ``model``'s ``W8A8Linear``s (module docstring)."""
    schemes: dict[Act, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, W8A8Linear):
            schemes.setdefault(m.act, []).append(path)
    new = any(act.ceiling is not None or act.kind == "fp8-static" for act in schemes)
    return {"quant_method": QUANT_METHOD, "version": VERSION if new else 1,
            "schemes": [{"kind": act.kind, "divisor": act.divisor, "floor": act.floor,
                         **({"ceiling": act.ceiling} if act.ceiling is not None else {}), "modules": paths}
                        for act, paths in schemes.items()]}


def stored_schemes(config: dict) -> dict[str, Act]:
    """Module path -> Act, from a ``quantization_config`` of this format (checked)."""
    version = config.get("version")
    if version not in VERSIONS:
        raise ValueError(f"fusepass: a checkpoint of format version {version!r}; this fusepass reads versions "
                         f"{', '.join(map(str, VERSIONS))}")
    return {path: Act(s["kind"], float(s["divisor"]), float(s["floor"]),
                      None if s.get("ceiling") is None else float(s["ceiling"]))
            for s in config.get("schemes", []) for path in s["modules"]}


def replace_for_loading(model: nn.Module, config: dict) -> None:
    """Put a ``Stored`` where each linear the config names is (on its device: meta, as
    transformers builds a model before loading it). A path may be relative to the model or to
    its base model (``base_model_prefix``: a checkpoint saved from a causal LM loads into the
    bare model, and one whose base model was prepared into the causal LM), as transformers
    takes the tensors' names."""
    prefix = getattr(model, "base_model_prefix", "")
    for path, act in stored_schemes(config).items():
        places = [path, f"{prefix}.{path}", path.removeprefix(f"{prefix}.")] if prefix else [path]
        found = next(((p, m) for p in places for m in [_module_at(model, p)] if m is not None), None)
        if found is None or not isinstance(found[1], nn.Linear):
            what = "nothing" if found is None else f"a {type(found[1]).__name__}"
            raise ValueError(f"fusepass: the checkpoint stores {path} as a W8A8 linear, but the model has {what} "
                             "there")
        parent_path, _, name = found[0].rpartition(".")
        linear = found[1]
        setattr(model.get_submodule(parent_path), name,
                Stored(linear.in_features, linear.out_features, act, linear.bias, linear.weight.device))


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def attach(model: nn.Module, left: dict[str, str]) -> None:
    """Make a prepared transformers model save in this format (module docstring): its config
    says so, and the quantizer it was loaded with (compressed-tensors', torchao's), which no
    longer describes its modules, is dropped. Not where ``prepare`` left quantized linears
    (``left``): the format cannot hold them, and the model keeps its source format's config
    (save it before ``prepare``). Nothing for a model that is not a transformers one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    if left:
        log.warning("fusepass.prepare: save_pretrained of this model writes its source format's config, which "
                    "does not describe fusepass's modules: %d quantized linear%s left as %s (a fusepass checkpoint "
                    "holds only what prepare converts)", len(left), "s" * (len(left) != 1),
                    "they are" if len(left) != 1 else "it is")
        return
    config.quantization_config = describe(model)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and getattr(quantizer.quantization_config, "quant_method", None) != QUANT_METHOD:
        model.hf_quantizer = None


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Calls ``register`` when transformers' quantizer registry is first imported: fusepass may
    be imported before transformers, and importing transformers here would cost every ``import
    fusepass`` seconds."""

    def __init__(self, register):
        self.register = register

    def find_spec(self, name, path, target=None):
        if name != _TRANSFORMERS_REGISTRY:
            return None
        sys.meta_path.remove(self)  # (the real finders find it; once)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(self.register)
        spec.loader.exec_module = exec_module
        return spec


def register_when_imported(register) -> None:
    """``register()`` (fusepass's format into transformers' registry: ``hf.register``) now if
    that registry is imported, else when it is."""
    if _TRANSFORMERS_REGISTRY in sys.modules:
        _register(register)
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport(register))


def _register(register) -> None:
    try:
        register()
    except Exception:  # (a transformers this code does not know: say so, load on)
        log.warning("fusepass: could not register its checkpoint format with transformers", exc_info=True)
