"""The ``torch.ops.fusepass.*`` custom ops; importing this package registers them."""

from .scaled_mm import scaled_mm, scaled_mm_azp

__all__ = ["scaled_mm", "scaled_mm_azp"]
