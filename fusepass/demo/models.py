"""The demo's model: a transformers causal LM (random from a config, or a checkpoint), its
W8A8 copy (torchao, or the hand-written linears of ``handwritten.py``), and the inputs of
its prefill and decode steps.

transformers and torchao are imported inside the functions: ``import fusepass`` needs neither.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import shutil
from dataclasses import dataclass

import torch
from fusepass_cli import QUANTS
from torch import nn

# compressed-tensors' scheme for each --quant (llm-compressor's presets; int8-asym: W8A8 with
# asymmetric dynamic activations, which the format takes but no preset names); fp8-block
# (DeepSeek-V3's 128x128 weight blocks) for the benchmark only: torchao has no such --quant
CT_SCHEMES = {"int8": "W8A8", "int8-asym": "W8A8_ASYM", "fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}
# set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning for
# the whole process, which made each compile of the CUDA demo model minutes long (bf16 decode
# step, 4 Llama-3-8B layers on an H200: 165 s vs 4 s) and changes the bf16 baseline's kernels
# too; every model of the demo compiles with Inductor's defaults instead.
TORCHAO_CONFIGS = {
    "int8": "Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)",
    "int8-asym": "Int8DynamicActivationInt8WeightConfig(act_mapping_type=MappingType.ASYMMETRIC, "
                 "set_inductor_config=False)",
    "fp8": "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)",
}


MOE_ARCHS = ("qwen3_moe", "olmoe")  # transformers' Qwen3MoeForCausalLM, OlmoeForCausalLM


@dataclass(frozen=True)
class Sizes:
    """The random model's sizes (transformers' LlamaConfig names)."""

    layers: int
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    arch: str = "llama"  # or "qwen3": Qwen3ForCausalLM (q/k norms, head size 128); or MOE_ARCHS
    experts: int = 0  # a mixture of experts (MOE_ARCHS): the experts of a layer,
    top_k: int = 0  # the experts each token is routed to,
    expert_size: int = 0  # and an expert's intermediate width

    def problems(self) -> list[str]:
        """What is wrong with these sizes, in the flags' words (empty if nothing)."""
        if min(self.layers, self.hidden_size, self.intermediate_size, self.heads, self.kv_heads, self.vocab_size) < 1:
            return ["--layers, --hidden-size, --intermediate-size, --heads, --kv-heads and --vocab-size must be >= 1"]
        out = []
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            out.append(f"--hidden-size ({self.hidden_size}) must divide by --heads ({self.heads}), "
                       f"and --heads by --kv-heads ({self.kv_heads})")
        elif (self.hidden_size // self.heads) % 8:
            out.append(f"the head size hidden-size / heads = {self.hidden_size // self.heads} must be a multiple of 8")
        if self.hidden_size % 16 or self.intermediate_size % 16:
            out.append(f"--hidden-size ({self.hidden_size}) and --intermediate-size ({self.intermediate_size}) "
                       "must be multiples of 16 (int8 matmuls' alignment)")
        return out


@contextlib.contextmanager
def quiet_imports():
    """Silence the warnings torchao's import logs (optional kernels not built for this
    machine, deprecated pytree registrations): nothing the demo uses."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def random_llama(sizes: Sizes, max_len: int, device: torch.device, seed: int, experts_impl: str | None = None) -> nn.Module:
    """A LlamaForCausalLM from a config: random weights, nothing downloaded. Weights are drawn
    like a trained model's scale (unit-variance activations through every linear), so that
    quantization error and greedy decoding look as they would on a real model. ``experts_impl``
    (a mixture of experts): transformers' experts implementation ("grouped_mm", "batched_mm",
    "eager"), else its default."""
    from transformers import AutoModelForCausalLM, LlamaConfig, OlmoeConfig, Qwen3Config, Qwen3MoeConfig

    kwargs = dict(
        hidden_size=sizes.hidden_size, intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
        vocab_size=sizes.vocab_size, max_position_embeddings=max_len, tie_word_embeddings=False,
    )
    if sizes.arch == "qwen3":
        config = Qwen3Config(**kwargs, head_dim=128)
    elif sizes.arch == "qwen3_moe":  # (every layer sparse; the experts' width is moe_intermediate_size)
        config = Qwen3MoeConfig(**kwargs, head_dim=128, num_experts=sizes.experts, num_experts_per_tok=sizes.top_k,
                                moe_intermediate_size=sizes.expert_size, norm_topk_prob=True)
    elif sizes.arch == "olmoe":  # (the experts' width is intermediate_size)
        config = OlmoeConfig(**{**kwargs, "intermediate_size": sizes.expert_size}, num_experts=sizes.experts,
                             num_experts_per_tok=sizes.top_k, eos_token_id=None, pad_token_id=None)
    else:
        config = LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        impl = {"experts_implementation": experts_impl} if experts_impl and sizes.arch in MOE_ARCHS else {}
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **impl)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=m.in_features**-0.5)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight)
            elif sizes.arch in MOE_ARCHS:  # (the experts' 3-D weights, and a router's: zeros route every token alike)
                for p in m.parameters(recurse=False):
                    if p.dim() >= 2:
                        nn.init.normal_(p, std=p.shape[-1]**-0.5)
    return model.eval()


def checkpoint(name: str) -> str:
    """``--model``'s value as from_pretrained takes it: a local directory where it names one
    (ValueError where it looks like a path but is not a directory), else a hub id."""
    local = os.path.expanduser(name)
    if os.path.isabs(local) or name.startswith((".", "~")) or os.path.exists(local):
        if not os.path.isdir(local):
            raise ValueError(f"--model {name}: no such directory")
        return local
    return name


# The W8A8 checkpoint formats the demo runs as they are (their config's quant_method):
# compressed-tensors', transformers' native FP8 (FP8Linear) and FBGEMM FP8 (FbgemmFp8Linear)
CHECKPOINT_FORMATS = ("compressed-tensors", "fp8", "fbgemm_fp8")


@functools.cache  # (the demo asks while it builds and again while it times)
def prequantized(name: str) -> str | None:
    """The quantization method of a checkpoint (a local directory or a hub id) that is already
    W8A8 (its config's ``quantization_config``: one of CHECKPOINT_FORMATS), else None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(checkpoint(name))
    except (OSError, ValueError, KeyError):
        return None  # (load_pretrained then says why)
    method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
    return method if method in CHECKPOINT_FORMATS else None


def load_pretrained(name: str, device: torch.device, dequantize: bool = False) -> nn.Module:
    """``from_pretrained`` of a local directory or a hub id (needs the network), in bf16,
    onto ``device`` (transformers builds a native FP8 checkpoint's FP8Linears where it loads
    on a GPU; on a CPU it dequantizes them); ``dequantize``: a W8A8 checkpoint's weights
    dequantized, with no activation quantization (its float model, as near as the checkpoint
    has one). Raises SystemExit with a one-line reason where it cannot."""
    from transformers import AutoModelForCausalLM

    try:
        name = checkpoint(name)
        method = prequantized(name)
        kwargs = {"device_map": str(device)} if method == "fp8" and device.type == "cuda" else {}
        if dequantize and method == "compressed-tensors":
            from transformers import CompressedTensorsConfig

            kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
        elif dequantize and method == "fp8":
            from transformers import FineGrainedFP8Config

            kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"fusepass demo: cannot load --model {name}: {reason}") from None
    if dequantize and method == "fbgemm_fp8":  # (transformers has no dequantize for it)
        _dequantize_fbgemm(model)
    if dequantize and method == "fp8":
        _dequantize_fp8_experts(model, name)
    return model.to(device).eval()


def _dequantize_fp8_experts(model: nn.Module, name: str) -> None:
    """transformers' ``FineGrainedFP8Config(dequantize=True)`` leaves a native FP8 checkpoint's
    experts as their raw fp8 values (without their block scales): each such experts module's
    weights dequantized from the checkpoint's ``FP8Experts`` (a second load, as a GPU loads it)."""
    from transformers import AutoModelForCausalLM

    from ..integrations.experts import is_experts

    raw = [path for path, m in model.named_modules() if is_experts(m) and m.gate_up_proj.element_size() == 1]
    if not raw:
        return
    quantized = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    for path in raw:
        module, fp8 = model.get_submodule(path), quantized.get_submodule(path)
        if type(fp8).__name__ != "FP8Experts":
            raise SystemExit(f"fusepass demo: cannot dequantize --model {name}'s experts {path}: transformers loaded "
                             f"them as {type(fp8).__name__} (FP8Experts load only where a GPU runs FP8)")
        for proj in ("gate_up_proj", "down_proj"):
            w, scale = getattr(fp8, proj).detach(), getattr(fp8, proj + "_scale_inv").detach().float()
            blocks = scale.repeat_interleave(128, 1)[:, : w.shape[1]].repeat_interleave(128, 2)[:, :, : w.shape[2]]
            setattr(module, proj, nn.Parameter((w.float() * blocks).to(torch.bfloat16), requires_grad=False))


def _dequantize_fbgemm(model: nn.Module) -> None:
    """Each FbgemmFp8Linear of ``model`` as a bf16 nn.Linear of its dequantized weight."""
    for path, m in list(model.named_modules()):
        if type(m).__name__ == "FbgemmFp8Linear":
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.bfloat16,
                               device=m.weight.device)
            linear.weight.data = (m.weight.float() * m.weight_scale.float().reshape(-1, 1)).to(torch.bfloat16)
            if m.bias is not None:
                linear.bias.data = m.bias.detach().to(torch.bfloat16)
            model.set_submodule(path, linear)


def transformers_fp8(model: nn.Module, block: tuple | None = (128, 128)) -> nn.Module:
    """``model`` (in place) as transformers holds a native FP8 checkpoint it loaded on a GPU:
    every linear but lm_head a transformers ``FP8Linear`` (128x128 weight blocks, or per-tensor
    where ``block`` is None), its weight quantized by transformers' own ``Fp8Quantize`` (what
    ``FineGrainedFP8Config`` does as a model loads), without a checkpoint written to disk. A
    mixture's experts are left as they are (``fusepass.quantize_experts`` takes them)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=block)
    linears = {path: m for path, m in model.named_modules() if type(m) is nn.Linear and path != "lm_head"}
    # (it would also put an empty FP8Experts, on the meta device, where each "*.experts" module is)
    experts = [path for path, _ in model.named_modules() if path.endswith(".experts")]
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head", *experts], quantization_config=config,
                            pre_quantized=False)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    for path, old in linears.items():
        new = model.get_submodule(path)
        values = quantize.convert({f"{path}.weight": old.weight.detach()})
        new.weight = nn.Parameter(values[f"{path}.weight"], requires_grad=False)
        new.weight_scale_inv = nn.Parameter(values[f"{path}.weight_scale_inv"].reshape(new.weight_scale_inv.shape),
                                            requires_grad=False)
        if old.bias is not None:
            new.bias = old.bias
    return model


def fbgemm_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FBGEMM's per-row fp8 quantization of a weight (``quantize_fp8_per_row``: amax / 448 a
    row, floored at 1e-12): (e4m3 values, (N, 1) fp32 scales)."""
    scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    return (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def fbgemm_fp8(model: nn.Module, activation_scale_ub: float = 1200.0) -> nn.Module:
    """``model`` (in place) as transformers holds an FBGEMM FP8 checkpoint (Meta's format) it
    loaded: every linear but lm_head a transformers ``FbgemmFp8Linear`` holding FBGEMM's
    per-row quantization of its weight (``fbgemm_rows``), ``input_scale_ub`` the config's bound."""
    from transformers.integrations.fbgemm_fp8 import FbgemmFp8Linear

    for path, old in [(p, m) for p, m in model.named_modules() if type(m) is nn.Linear and p != "lm_head"]:
        with torch.device("meta"):
            new = FbgemmFp8Linear(old.in_features, old.out_features, old.bias is not None)
        q, scale = fbgemm_rows(old.weight.detach())
        new.weight = nn.Parameter(q, requires_grad=False)
        new.weight_scale = nn.Parameter(scale, requires_grad=False)
        new.input_scale_ub = torch.tensor([activation_scale_ub], device=q.device)
        new.bias = old.bias
        model.set_submodule(path, new)
    return model


def compressed_tensors(model: nn.Module, scheme: str):
    """``model`` (in place) as a compressed-tensors checkpoint of ``scheme`` (a preset name, or
    W8A8_ASYM) loads: scheme applied to every linear but lm_head, per-channel weight scales
    from each weight's min and max (llm-compressor's min-max observer), weights compressed to
    int8 / fp8, the hook that decompresses them at the first forward in place. Returns the
    compressor (``save`` writes a checkpoint with it)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    preset = preset_name_to_scheme("W8A8" if scheme == "W8A8_ASYM" else scheme, ["Linear"])
    if scheme == "W8A8_ASYM":
        preset.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=False,
                                                    dynamic=True)
        preset = QuantizationScheme.model_validate(preset.model_dump())
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"]))
    for m in model.modules():
        args = getattr(getattr(m, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = m.weight.data.float()
        if str(args.strategy) == "block":  # (min and max per block: weights of whole blocks here)
            rows, cols = args.block_structure
            if w.shape[0] % rows or w.shape[1] % cols:
                raise ValueError(f"{scheme}: {type(m).__name__} weight {tuple(w.shape)} is not whole {rows}x{cols} "
                                 f"blocks (sizes of the model: multiples of {rows})")
            w = w.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols)).transpose(1, 2).flatten(-2)
            lo, hi = w.amin(-1), w.amax(-1)
        else:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero_point = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale.to(m.weight_scale.dtype))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero_point.to(m.weight_zero_point.dtype))
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def save_compressed(model: nn.Module, compressor, path) -> None:
    """A compressed-tensors checkpoint of ``model`` (``compressed_tensors``'s) at ``path``."""
    compressor.remove_decompression_hook(model)
    model.save_pretrained(path)
    compressor.update_config(path)


def save_compressed_moe(model: nn.Module, scheme: str, path) -> None:
    """A compressed-tensors checkpoint of the mixture of experts ``model`` at ``path``, as
    llm-compressor writes one: each expert's linears apart under the checkpoint's names (as
    transformers saves them), they and attention's linears quantized and compressed by
    compressed-tensors (``compressed_tensors``: ``scheme``), the routers, norms, embeddings and
    lm_head left in the model's dtype and named in ``ignore``."""
    import json
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(tmp, name), "pt") as f:
                    tensors.update({k: f.get_tensor(k) for k in f.keys()})
        linears = nn.Module()  # the checkpoint's linears, as nn.Linear modules under their own names
        for key, value in tensors.items():
            module = key.removesuffix(".weight")
            if key == module or value.dim() != 2 or _IGNORED.search(module):
                continue
            parent = linears
            for part in module.split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            linear = nn.Linear(value.shape[1], value.shape[0], bias=False, dtype=value.dtype)
            linear.weight.data.copy_(value)
            parent.add_module(module.rsplit(".", 1)[-1], linear)
        compressor = compressed_tensors(linears, scheme)
        quantized = linears.state_dict()
        kept = {k: v for k, v in tensors.items() if k.removesuffix(".weight") + ".weight_scale" not in quantized}
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(tmp):
            if not name.endswith(".safetensors") and not name.endswith(".index.json"):
                shutil.copy(os.path.join(tmp, name), path)
    save_file({k: v.contiguous() for k, v in {**kept, **quantized}.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    compressor.update_config(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = IGNORE_MOE
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# What a MoE checkpoint's compressed-tensors config leaves in the model's dtype (as the hub's
# Qwen3-30B-A3B-FP8-dynamic does): lm_head and the routers (Mixtral's ``block_sparse_moe.gate``).
IGNORE_MOE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]
_IGNORED = re.compile(r"(^lm_head$|\.gate$|norm|embed)")


def _sharing_experts(model: nn.Module) -> nn.Module:
    """A deep copy of a MoE ``model`` that shares its experts' float weights instead of copying
    them (a full-size model's are most of its bytes): the copy's quantization replaces them there
    and leaves the original's."""
    from ..integrations.experts import is_experts

    shared = {id(p): p for m in model.modules() if is_experts(m) for p in m.parameters(recurse=False)}
    return copy.deepcopy(model, memo=dict(shared))


def _experts_copy(model: nn.Module, quant: str) -> nn.Module:
    """A W8A8 copy of a MoE ``model``: its experts by ``fusepass.quantize_experts``, its other
    nn.Linears (attention; the routers are not nn.Linear) by torchao (``fp8-block``: as
    transformers' native FP8 ``FP8Linear``s). The experts' float weights are shared, then
    dropped (``_sharing_experts``)."""
    from ..integrations.experts import quantize_experts

    qmodel = _sharing_experts(model)
    report = quantize_experts(qmodel, quant if quant in ("fp8", "fp8-block") else "int8")
    if report.left:
        raise ValueError(f"experts left as they are: {report}")
    if quant == "fp8-block":  # (attention's linears as a native FP8 checkpoint's: 128x128 blocks)
        return transformers_fp8(qmodel, (128, 128))
    return _torchao(qmodel, quant)


def _torchao_experts_copy(model: nn.Module, quant: str) -> nn.Module:
    """A copy of a MoE ``model`` in torchao's fp8 per row alone, the PyTorch-native path that
    fusepass's MoE variants are held against: its experts' 3-D weights become torchao
    ``Float8Tensor``s, which transformers' own experts code runs (its ``grouped_mm`` on them is
    torchao's, on torch's ``scaled_grouped_mm``), and its other nn.Linears torchao's too. torchao
    quantizes to fp8 on GPUs of compute capability 8.9 and above."""
    if quant != "fp8":
        raise ValueError(f"{quant}: torchao quantizes experts' 3-D weights in fp8 per row only")
    from ..integrations.experts import is_experts

    qmodel = _sharing_experts(model)
    config = _torchao_config("fp8")
    params = {f"{name}.{p}": config for name, m in qmodel.named_modules() if is_experts(m)
              for p in ("gate_up_proj", "down_proj")}
    if not params:
        raise ValueError("torchao-experts: the model has no experts (transformers' 3-D gate_up_proj / down_proj)")
    with quiet_imports():
        from torchao.quantization import FqnToConfig, quantize_

        quantize_(qmodel, FqnToConfig(params), filter_fn=None)
    return _torchao(qmodel, quant)


def quantized_copy(model: nn.Module, quant: str, quantizer: str) -> nn.Module:
    """A W8A8 copy of ``model``: every nn.Linear (lm_head included) quantized by torchao's
    config for ``quant`` (TORCHAO_CONFIGS), or by the hand-written QuantLinear; or, by
    compressed-tensors, every one but lm_head, as its checkpoint of ``CT_SCHEMES[quant]``
    loads; or (``experts``, a mixture of experts) its experts by ``fusepass.quantize_experts``
    and its other linears by torchao; or (``torchao-experts``) all of them by torchao, fp8."""
    if quantizer == "experts":
        return _experts_copy(model, quant)
    if quantizer == "torchao-experts":
        return _torchao_experts_copy(model, quant)
    qmodel = copy.deepcopy(model)
    if quantizer == "handwritten":
        from .handwritten import quantize

        return quantize(qmodel, quant)
    if quantizer == "compressed-tensors":
        compressed_tensors(qmodel, CT_SCHEMES[quant])
        return qmodel
    if quantizer == "transformers":  # (its native FP8 format: 128x128 blocks, or per-tensor)
        return transformers_fp8(qmodel, (128, 128) if quant == "fp8-block" else None)
    if quantizer == "fbgemm":
        return fbgemm_fp8(qmodel)
    return _torchao(qmodel, quant)


def _torchao(qmodel: nn.Module, quant: str) -> nn.Module:
    """``qmodel``'s nn.Linears quantized in place by torchao's config for ``quant``."""
    if quant not in QUANTS:
        raise ValueError(f"{quant}: compressed-tensors only (torchao's: {', '.join(QUANTS)})")
    config = _torchao_config(quant)
    with quiet_imports():
        from torchao.quantization import quantize_

        quantize_(qmodel, config)  # (it imports more of torchao)
    return qmodel


def _torchao_config(quant: str):
    """torchao's config for ``quant`` (``int8``, ``int8-asym``, ``fp8``: per row)."""
    with quiet_imports():
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Int8DynamicActivationInt8WeightConfig,
            MappingType,
            PerRow,
        )
        return {
            "int8": lambda: Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
            "int8-asym": lambda: Int8DynamicActivationInt8WeightConfig(
                act_mapping_type=MappingType.ASYMMETRIC, set_inductor_config=False),
            "fp8": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False),
        }[quant]()


def describe(model: nn.Module) -> str:
    c = model.config
    return (f"{type(model).__name__}, {c.num_hidden_layers} layer{'s' * (c.num_hidden_layers != 1)}, "
            f"hidden {c.hidden_size}, intermediate "
            f"{c.intermediate_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, "
            f"vocab {c.vocab_size}")


def prompt(model: nn.Module, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids [batch, length] (no tokenizer needed; the same for every model)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(model.device)


def prefill_inputs(ids: torch.Tensor) -> dict:
    """The prefill step as generate runs it: the whole prompt, logits of its last position."""
    return dict(input_ids=ids, use_cache=False, logits_to_keep=1)


def head_dim(config) -> int:
    """The attention head size of a transformers config."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def static_cache(model: nn.Module, batch: int, max_len: int):
    """A transformers StaticCache, allocated now (not inside a compiled region)."""
    from transformers import StaticCache

    c = model.config
    cache = StaticCache(config=c, max_cache_len=max_len)
    cache.early_initialization(batch_size=batch, num_heads=c.num_key_value_heads, head_dim=head_dim(c),
                               dtype=torch.bfloat16, device=model.device)
    return cache


def decode_inputs(ids: torch.Tensor, cache) -> dict:
    """One decode step: one new token per sequence, appended to ``cache`` (a StaticCache,
    whose attention spans all its slots whatever their fill)."""
    return dict(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
