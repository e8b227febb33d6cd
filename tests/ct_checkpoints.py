"""Small W8A8 checkpoints in the compressed-tensors format, written by compressed-tensors itself
(as llm-compressor writes them, without llm-compressor or a download): a random bf16 Llama,
a quantization scheme applied, per-channel weight scales from each weight's min and max (as
llm-compressor's min-max observer computes them), compressed and saved with its
``quantization_config``. Also saves the bf16 model it started from (the float reference)."""

from __future__ import annotations

from pathlib import Path

import torch

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False)
SCHEMES = ("W8A8", "W8A8_ASYM", "FP8_DYNAMIC", "W8A16")
QUANTIZED_LINEARS = 7 * SIZES["num_hidden_layers"]  # lm_head is left in bf16, as llm-compressor does


def _scheme(name: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if name == "W8A8_ASYM":  # not a preset: int8 weights, asymmetric dynamic per-token activations
        scheme = preset_name_to_scheme("W8A8", ["Linear"])
        scheme.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=False,
                                                    dynamic=True)
        return QuantizationScheme.model_validate(scheme.model_dump())
    return preset_name_to_scheme(name, ["Linear"])


def build(root: Path, name: str, seed: int = 0) -> tuple[Path, Path]:
    """(the checkpoint's directory, the bf16 model's), under ``root``."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).to(torch.bfloat16).eval()
    for m in model.modules():  # a trained model's scale: unit-variance activations through each linear
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=m.in_features**-0.5)
    float_dir, out = root / "bf16", root / name
    model.save_pretrained(float_dir)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": _scheme(name)}, ignore=["lm_head"]))
    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w = m.weight.data.float()
        scale, zero_point = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
        m.weight_scale.data.copy_(scale.to(m.weight_scale.dtype))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero_point.to(m.weight_zero_point.dtype))
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out, float_dir


def load(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
