"""What fusepass integrates with, above the pass: quantized models of other libraries
(``prepare``: the checkpoint formats of ``formats/`` as plain-tensor linears), and fusepass's
own checkpoints (``saved.py``, ``hf.py``)."""

from .experts import W8A8Experts, quantize_experts
from .linear import Act, Joint, W8A8Linear
from .prepare import Preparation, prepare

__all__ = ["Act", "Joint", "Preparation", "W8A8Experts", "W8A8Linear", "prepare", "quantize_experts"]
