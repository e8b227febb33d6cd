"""fusepass's checkpoint format in transformers: its ``quantization_config`` class and its
quantizer (``saved.py`` says what the format holds). Imported only with transformers."""

from __future__ import annotations

import copy

from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from .saved import QUANT_METHOD, VERSION, replace_for_loading


class FusepassConfig(QuantizationConfigMixin):
    """``quantization_config`` of a checkpoint saved from a ``fusepass.prepare``d model."""

    def __init__(self, schemes: list | None = None, version: int = VERSION, **kwargs):
        self.quant_method = QUANT_METHOD
        self.version = version
        self.schemes = list(schemes or [])

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "version": self.version, "schemes": copy.deepcopy(self.schemes)}


class FusepassQuantizer(HfQuantizer):
    """Loads a fusepass checkpoint: ``Stored`` modules in place of the linears it names, then
    ``prepare`` (values and scales as saved, siblings joined again)."""

    requires_calibration = True  # (it loads checkpoints; it does not quantize)

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)

    def validate_environment(self, *args, **kwargs):
        pass

    def _process_model_before_weight_loading(self, model, **kwargs):
        replace_for_loading(model, self.quantization_config.to_dict())

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .prepare import prepare

        report = prepare(model)
        if report.left:  # (nothing of this format is left: a checkpoint that does not fit it)
            raise ValueError(f"fusepass: the checkpoint's linears did not all load as saved: {report}")
        return model

    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self):  # (the input's gradient flows through the frozen weights)
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(FusepassConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(FusepassQuantizer)
