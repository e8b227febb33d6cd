"""Small W8A8 checkpoints in the compressed-tensors format, written by compressed-tensors itself
(as llm-compressor writes them, without llm-compressor or a download; ``fusepass.demo.models.
compressed_tensors``): a random bf16 Llama, quantized, compressed and saved with its
``quantization_config``; and the bf16 model it started from (the float reference)."""

from __future__ import annotations

from pathlib import Path

import torch

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False)
# FP8_BLOCK's weights must be whole 128x128 blocks: k/v's N = kv heads x head size = 128
BLOCK_SIZES = {**SIZES, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
               "num_key_value_heads": 1}
SCHEMES = ("W8A8", "W8A8_ASYM", "FP8_DYNAMIC", "FP8_BLOCK", "W8A16")
QUANTIZED_LINEARS = 7 * SIZES["num_hidden_layers"]  # lm_head is left in bf16, as llm-compressor does


def build(root: Path, name: str, seed: int = 0) -> tuple[Path, Path]:
    """(the checkpoint's directory, the bf16 model's), under ``root``."""
    import transformers

    from fusepass.demo.models import compressed_tensors, save_compressed

    torch.manual_seed(seed)
    sizes = BLOCK_SIZES if name == "FP8_BLOCK" else SIZES
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).to(torch.bfloat16).eval()
    for m in model.modules():  # a trained model's scale: unit-variance activations through each linear
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=m.in_features**-0.5)
    float_dir, out = root / f"bf16-{name}", root / name
    model.save_pretrained(float_dir)
    save_compressed(model, compressed_tensors(model, name), out)
    return out, float_dir


def load(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
