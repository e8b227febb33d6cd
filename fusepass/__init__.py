"""fusepass: fused W8A8 (int8 / fp8) quantized linear layers under torch.compile."""

from .ops import scaled_mm, scaled_mm_azp

__all__ = ["scaled_mm", "scaled_mm_azp"]
