"""The ``torch.ops.fusepass.*`` custom ops; importing this package registers them."""

from .scaled_mm import int_mm, scaled_mm, scaled_mm_azp

__all__ = ["int_mm", "scaled_mm", "scaled_mm_azp"]
