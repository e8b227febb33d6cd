"""Small FP8 checkpoints in the formats transformers loads as its own FP8 modules, built as the
hub's are:

- native FP8 (``quant_method: "fp8"``: Qwen3-*-FP8, DeepSeek-V3's format; ``FP8Linear``): a
  random bf16 Llama or Qwen3 saved, loaded by transformers with ``FineGrainedFP8Config``
  (transformers quantizes it), saved again; ``load`` reads it back with ``from_pretrained``;
- FBGEMM FP8 (``quant_method: "fbgemm_fp8"``: Meta's FP8 releases; ``FbgemmFp8Linear``):
  fbgemm-gpu, which transformers quantizes with, has no CPU build, so the checkpoint is written
  as Meta's are: each quantized linear's ``weight`` in e4m3 and ``weight_scale`` (N, 1) fp32 by
  FBGEMM's per-row recipe, the config's ``activation_scale_ub`` and ``modules_to_not_convert``
  (lm_head and the first layer's attention, as Meta leaves some in bf16).

On a machine without a GPU of compute capability 8.9 or more, transformers dequantizes a
native FP8 checkpoint to bf16 as it loads it, and refuses to quantize one: ``gpu_gate_skipped``
skips that check (``validate_environment``), in these tests only, so a CPU builds and loads the
``FP8Linear`` modules a GPU load builds. On a GPU nothing is skipped.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from fusepass.demo.models import fbgemm_rows

SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False)
ARCHS = ("llama", "qwen3")  # (Qwen3: q/k norms, head_dim 128: k/v's N = 128, whole 128x128 blocks)
LINEARS = 7 * SIZES["num_hidden_layers"]
FBGEMM_BF16 = ["lm_head"] + [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
FBGEMM_LINEARS = LINEARS - 4
ACTIVATION_SCALE_UB = 1200.0


def bf16_model(arch: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**SIZES)
    else:
        config = transformers.Qwen3Config(**SIZES, head_dim=128)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    for m in model.modules():  # a trained model's scale: unit-variance activations through each linear
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=m.in_features**-0.5)
    return model


@contextlib.contextmanager
def gpu_gate_skipped():
    """transformers' FP8 quantizer without its GPU check (module docstring); nothing on a GPU."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    if torch.cuda.is_available():
        yield
        return
    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check


def native(root: Path, arch: str, block: tuple | None = (128, 128), seed: int = 0) -> tuple[Path, Path]:
    """(a native FP8 checkpoint's directory, the bf16 model's) under ``root``: 128x128 blocks,
    or per-tensor weight scales where ``block`` is None."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    float_dir, out = root / f"bf16-{arch}", root / f"fp8-{arch}-{'block' if block else 'tensor'}"
    bf16_model(arch, seed).save_pretrained(float_dir)
    with gpu_gate_skipped():
        quantized = AutoModelForCausalLM.from_pretrained(
            float_dir, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(weight_block_size=block))
    quantized.save_pretrained(out)
    if block is None:  # (transformers 5.24 saves a per-tensor scale [1, 1], which its FP8Linear, 0-d, refuses)
        _rewrite(out, lambda tensors: {k: v.reshape(()) if k.endswith("weight_scale_inv") else v
                                       for k, v in tensors.items()})
    return out, float_dir


def _rewrite(path: Path, change) -> None:
    """The checkpoint's tensors at ``path`` replaced by ``change(tensors)``."""
    from safetensors.torch import load_file, save_file

    save_file(change(load_file(path / "model.safetensors")), path / "model.safetensors", metadata={"format": "pt"})


def static(root: Path, arch: str, calibration: torch.Tensor) -> Path:
    """A per-tensor native FP8 checkpoint with ``activation_scheme: "static"``: each linear's
    ``activation_scale`` calibrated as amax / 448 over the bf16 model's inputs to it on
    ``calibration`` (token ids), written beside the weights, as a calibrating tool writes them."""
    path, float_dir = native(root / "static", arch, block=None)
    model = load(float_dir)
    amax, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            hooks.append(m.register_forward_hook(
                lambda m, args, out, name=name: amax.__setitem__(name, args[0].float().abs().amax())))
    with torch.no_grad():
        model(calibration)
    for h in hooks:
        h.remove()
    _rewrite(path, lambda tensors: {**tensors, **{f"{name}.activation_scale": (value / 448).reshape(())
                                                  for name, value in amax.items()}})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (path / "config.json").write_text(json.dumps(config))
    return path


def fbgemm(root: Path, arch: str = "llama", seed: int = 0) -> tuple[Path, Path]:
    """(an FBGEMM FP8 checkpoint's directory, the bf16 model's) under ``root`` (module
    docstring)."""
    float_dir, out = root / f"bf16-{arch}", root / f"fbgemm-{arch}"
    model = bf16_model(arch, seed)
    model.save_pretrained(float_dir)
    model.save_pretrained(out)

    def quantized(tensors):
        for key in list(tensors):
            module = key.removesuffix(".weight")
            if key.endswith("_proj.weight") and module not in FBGEMM_BF16:
                tensors[key], tensors[f"{module}.weight_scale"] = fbgemm_rows(tensors[key])
        return tensors
    _rewrite(out, quantized)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": ACTIVATION_SCALE_UB,
                                     "modules_to_not_convert": FBGEMM_BF16}
    (out / "config.json").write_text(json.dumps(config))
    return out, float_dir


def load(path: Path, **kwargs):
    """``from_pretrained`` as a user calls it (a CPU load of a native FP8 checkpoint with the
    GPU gate skipped: module docstring)."""
    import transformers

    with gpu_gate_skipped():
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()
