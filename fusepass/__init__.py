"""fusepass: fused W8A8 (int8 / fp8) quantized linear layers under torch.compile.

Three ways in: ``torch.compile(model, backend="fusepass")``;
``torch.compile(model, options=fusepass.inductor_options())``; or the ops themselves,
``fusepass.scaled_mm`` / ``fusepass.scaled_mm_azp`` / ``fusepass.scaled_mm_blockwise`` /
``fusepass.scaled_mm_group``
(``torch.ops.fusepass.*``).
``fusepass.explain(model, *inputs)`` reports what the pass fuses and why not.
"""

from .backend import fusepass_backend, inductor_options
from .explain import Report, explain
from .ops import int_mm, scaled_mm, scaled_mm_azp, scaled_mm_blockwise, scaled_mm_group
from .passes import FusePass, PassConfig

__all__ = [
    "FusePass",
    "PassConfig",
    "Report",
    "explain",
    "fusepass_backend",
    "inductor_options",
    "int_mm",
    "scaled_mm",
    "scaled_mm_azp",
    "scaled_mm_blockwise",
    "scaled_mm_group",
]
