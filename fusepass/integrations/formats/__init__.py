"""The checkpoint formats ``prepare`` converts, one module each, in the order it tries them
(``FORMATS``): each recognizes its own modules and says why where it cannot convert one."""

from . import compressed_tensors, fusepass, torchao, transformers_fp8
from .base import Format, Quantized

FORMATS = (torchao.FORMAT, compressed_tensors.FORMAT, fusepass.FORMAT, transformers_fp8.FORMAT)

__all__ = ["FORMATS", "Format", "Quantized"]
