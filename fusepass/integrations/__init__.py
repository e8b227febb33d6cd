"""What fusepass integrates with, above the pass: quantized models of other libraries
(``prepare``: torchao's tensor subclasses and compressed-tensors checkpoints as plain-tensor
linears)."""

from .linear import Act, Joint, W8A8Linear
from .prepare import Preparation, prepare

__all__ = ["Act", "Joint", "Preparation", "W8A8Linear", "prepare"]
