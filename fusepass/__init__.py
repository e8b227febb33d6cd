"""fusepass: fused W8A8 (int8 / fp8) quantized linear layers under torch.compile.

Three ways in: ``torch.compile(model, backend="fusepass")``;
``torch.compile(model, options=fusepass.inductor_options())``; or the ops themselves,
``fusepass.scaled_mm`` / ``fusepass.scaled_mm_azp`` / ``fusepass.scaled_mm_blockwise`` /
``fusepass.scaled_mm_group`` / ``fusepass.scaled_mm_dynamic`` / ``fusepass.scaled_mm_blockwise_dynamic``
(``torch.ops.fusepass.*``).
``fusepass.explain(model, *inputs)`` reports what the pass fuses and why not;
``fusepass.prepare(model)`` turns a torchao or compressed-tensors model's quantized linears into
plain-tensor ones, once.
"""

from ._compat import warn_untested
from .backend import fusepass_backend, inductor_options
from .explain import Report, explain
from .integrations import Preparation, W8A8Experts, W8A8Linear, prepare, quantize_experts
from .integrations.saved import register_when_imported
from .ops import (int_mm, route_experts, scaled_grouped_mm, scaled_grouped_mm_dynamic, scaled_mm, scaled_mm_azp,
                  scaled_mm_blockwise, scaled_mm_blockwise_dynamic, scaled_mm_dynamic, scaled_mm_group)
from .passes import FusePass, PassConfig


def _register_format() -> None:
    from .integrations import hf

    hf.register()


warn_untested()
register_when_imported(_register_format)  # (fusepass's checkpoint format, for transformers' from_pretrained)

__all__ = [
    "FusePass",
    "PassConfig",
    "Preparation",
    "Report",
    "W8A8Experts",
    "W8A8Linear",
    "explain",
    "fusepass_backend",
    "inductor_options",
    "prepare",
    "quantize_experts",
    "int_mm",
    "scaled_mm",
    "scaled_mm_azp",
    "scaled_mm_blockwise",
    "scaled_mm_blockwise_dynamic",
    "scaled_mm_dynamic",
    "scaled_mm_group",
    "scaled_grouped_mm",
    "scaled_grouped_mm_dynamic",
    "route_experts",
]
