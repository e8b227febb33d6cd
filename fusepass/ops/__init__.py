"""The ``torch.ops.fusepass.*`` custom ops; importing this package registers them."""

from .scaled_mm import int_mm, scaled_mm, scaled_mm_azp
from .blockwise import scaled_mm_blockwise, scaled_mm_blockwise_dynamic
from .group import scaled_mm_group
from .grouped import route_experts, scaled_grouped_mm
from .dynamic import scaled_mm_dynamic
from .grouped_dynamic import scaled_grouped_mm_dynamic
from . import sharding  # noqa: F401  (after the ops exist) registers their DTensor sharding rules

__all__ = ["int_mm", "route_experts", "scaled_mm", "scaled_mm_azp", "scaled_mm_blockwise", "scaled_mm_blockwise_dynamic",
           "scaled_mm_dynamic",
           "scaled_grouped_mm", "scaled_grouped_mm_dynamic", "scaled_mm_group"]
