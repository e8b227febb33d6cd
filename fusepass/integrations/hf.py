"""fusepass in transformers' quantizer registry: its own checkpoint format's
``quantization_config`` class and quantizer (``saved.py`` says what the format holds), and a
loader of FBGEMM FP8 checkpoints that needs no fbgemm-gpu. Imported only with transformers."""

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


FBGEMM_FP8 = "fbgemm_fp8"


def _unprepared(*args, **kwargs):
    raise RuntimeError("fusepass: this FBGEMM FP8 checkpoint was loaded without fbgemm-gpu, whose kernels its "
                       "FbgemmFp8Linear modules call: run it after fusepass.prepare(model), which converts them")


def _fbgemm_loader():
    """transformers' FBGEMM FP8 quantizer, but for loading a checkpoint (Meta's FP8 releases:
    ``quant_method: "fbgemm_fp8"``) where fbgemm-gpu is not installed, or on a CPU: the same
    ``FbgemmFp8Linear`` modules, their tensors loaded as transformers loads them, for ``prepare``
    to convert. Its ``validate_environment`` refuses both (fbgemm-gpu, a GPU), and building the
    modules reads ``torch.ops.fbgemm``: here that read gives the modules a function that says to
    prepare the model first (their forward calls fbgemm-gpu's kernels). Quantizing a bf16 model
    on load still needs fbgemm-gpu (transformers' own quantizer). transformers 5.17-5.24."""
    from transformers.integrations import fbgemm_fp8
    from transformers.quantizers.quantizer_fbgemm_fp8 import FbgemmFp8HfQuantizer
    from transformers.utils import is_accelerate_available

    class FbgemmFp8Loader(FbgemmFp8HfQuantizer):
        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ImportError("FBGEMM FP8 quantization of a model as it loads needs fbgemm-gpu (fusepass loads "
                                  "FBGEMM FP8 checkpoints without it, and does not quantize)")
            if not is_accelerate_available():
                raise ImportError("loading an FBGEMM FP8 checkpoint needs accelerate (`pip install accelerate`)")

        def _process_model_before_weight_loading(self, model, **kwargs):
            builder = fbgemm_fp8.get_quantize_fp8_per_row
            fbgemm_fp8.get_quantize_fp8_per_row = lambda: _unprepared
            try:
                super()._process_model_before_weight_loading(model, **kwargs)
            finally:
                fbgemm_fp8.get_quantize_fp8_per_row = builder

    return FbgemmFp8Loader


def register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(FusepassConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(FusepassQuantizer)
    import torch
    from transformers.utils import is_fbgemm_gpu_available

    # (with fbgemm-gpu on a GPU, transformers' own quantizer loads the same modules)
    if not (is_fbgemm_gpu_available() and torch.cuda.is_available()) and FBGEMM_FP8 in AUTO_QUANTIZER_MAPPING:
        AUTO_QUANTIZER_MAPPING[FBGEMM_FP8] = _fbgemm_loader()
