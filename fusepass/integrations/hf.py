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

from .saved import QUANT_METHOD, VERSION, Stored, replace_for_loading


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

        missing = _not_loaded(model)
        if missing:  # (transformers fills a missing tensor with its own initialization, and only warns)
            raise ValueError(f"fusepass: the checkpoint lacks {', '.join(missing)}")
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


def _not_loaded(model) -> list[str]:
    """The names of ``Stored`` tensors the checkpoint did not hold: transformers (5.17-5.24)
    marks each tensor it loads ``_is_hf_initialized``; none where no tensor is marked (a
    transformers that does not mark them)."""
    stored = [(f"{path}.{name}", t) for path, m in model.named_modules() if isinstance(m, Stored)
              for name, t in m.named_parameters()]
    if not any(getattr(t, "_is_hf_initialized", False) for _, t in stored):
        return []
    return [name for name, t in stored if not getattr(t, "_is_hf_initialized", False)]


FBGEMM_FP8 = "fbgemm_fp8"


def _unprepared(*args, **kwargs):
    raise RuntimeError("fusepass: FbgemmFp8Linear calls fbgemm-gpu, not installed here: run the model after "
                       "fusepass.prepare(model)")


def _fbgemm_loader():
    """transformers' FBGEMM FP8 quantizer, which also loads a checkpoint (Meta's FP8 releases:
    ``quant_method: "fbgemm_fp8"``) where its own environment check refuses to: without
    fbgemm-gpu, or on a CPU. Then the same ``FbgemmFp8Linear`` modules, their tensors loaded as
    transformers loads them, for ``prepare`` to convert; building them reads
    ``torch.ops.fbgemm``, and here that read gives them a function that says to prepare the
    model first (their forward calls fbgemm-gpu's kernels). Where transformers' check passes
    (fbgemm-gpu on a GPU, its XPU kernels) nothing changes. Not without fbgemm-gpu: quantizing
    a bf16 model as it loads, and Llama-4's MoE experts (fusepass runs no MoE experts yet).
    transformers 5.17-5.24."""
    from transformers.integrations import fbgemm_fp8
    from transformers.quantizers.quantizer_fbgemm_fp8 import FbgemmFp8HfQuantizer
    from transformers.utils import is_accelerate_available

    class FbgemmFp8Loader(FbgemmFp8HfQuantizer):
        without_fbgemm = False

        def validate_environment(self, *args, **kwargs):
            try:
                return super().validate_environment(*args, **kwargs)
            except ImportError as e:  # (no fbgemm-gpu, or no GPU)
                if not self.pre_quantized:
                    raise ImportError(f"{e} (fusepass loads FBGEMM FP8 checkpoints without it, and does not "
                                      "quantize)") from None
            if not is_accelerate_available():
                raise ImportError("loading an FBGEMM FP8 checkpoint needs accelerate (`pip install accelerate`)")
            self.without_fbgemm = True

        def _process_model_before_weight_loading(self, model, **kwargs):
            if not self.without_fbgemm:
                return super()._process_model_before_weight_loading(model, **kwargs)
            if any(type(m).__name__ == "Llama4TextExperts" for m in model.modules()):
                raise ImportError("this FBGEMM FP8 checkpoint's MoE experts (Llama-4's) run on fbgemm-gpu's kernels "
                                  "only: install fbgemm-gpu (fusepass runs no MoE experts yet)")
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
    if FBGEMM_FP8 in AUTO_QUANTIZER_MAPPING:
        AUTO_QUANTIZER_MAPPING[FBGEMM_FP8] = _fbgemm_loader()
