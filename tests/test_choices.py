"""Inductor's choices under the fusepass backend (fusepass/choices.py): a decode-size
CUDA row reduction stays one kernel; everything else is Inductor's own rule."""

import pytest
import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

import fusepass
from fusepass.choices import DecodeReductionChoices, decode_reductions

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def stock_says_7(monkeypatch):
    """Inductor's own rule, as a marker: it needs a GPU's properties to run."""
    monkeypatch.setattr(InductorChoices, "reduction_split_factor", staticmethod(lambda *args: 7))


@pytest.mark.parametrize("k", [4096, 14336, 28672, 32768])
@pytest.mark.parametrize("rows", [1, 16])
def test_decode_row_reductions_are_not_split(stock_says_7, rows, k):
    assert DecodeReductionChoices.reduction_split_factor(CUDA, k, rows, True) == 1


@pytest.mark.parametrize("device, k, rows, inner", [
    (CUDA, 32769, 1, True),    # longer rows: one program per row would be slow
    (CUDA, 14336, 17, True),   # not a decode size
    (CUDA, 14336, 1, False),   # an outer reduction
    (CPU, 14336, 1, True),     # CPU code is Inductor's to decide
], ids=["long-row", "17-rows", "outer", "cpu"])
def test_other_reductions_follow_inductor(stock_says_7, device, k, rows, inner):
    assert DecodeReductionChoices.reduction_split_factor(device, k, rows, inner) == 7


def _spy_compile(monkeypatch):
    seen = []

    def compile_fx(gm, example_inputs, config_patches):
        seen.append((type(V.choices), config_patches["post_grad_custom_pre_pass"].uuid()))
        return gm

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", compile_fx)
    return seen


def test_the_backend_compiles_with_them_and_keys_the_cache_apart(monkeypatch):
    seen = _spy_compile(monkeypatch)
    fusepass.fusepass_backend(None, [])
    (choices, uuid), = seen
    assert choices is DecodeReductionChoices
    assert type(V.choices) is InductorChoices  # restored
    # the same pass under stock Inductor's choices (options=inductor_options()) has another key
    assert uuid != fusepass.FusePass().uuid()


def test_a_callers_own_choices_are_kept(monkeypatch):
    class Mine(InductorChoices):
        pass

    seen = _spy_compile(monkeypatch)
    with V.set_choices_handler(Mine()):
        fusepass.fusepass_backend(None, [])
        with decode_reductions():
            assert type(V.choices) is Mine
    assert seen[0][0] is Mine


def test_choices_given_as_an_option_are_kept(monkeypatch):
    class Mine(InductorChoices):
        pass

    seen = _spy_compile(monkeypatch)
    fusepass.fusepass_backend(None, [], options={"inductor_choices_class": Mine})
    assert seen[0][0] is InductorChoices  # compile_fx applies the option itself; not replaced here


def test_restored_after_a_failed_compile(monkeypatch):
    def compile_fx(gm, example_inputs, config_patches):
        raise RuntimeError("boom")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", compile_fx)
    with pytest.raises(RuntimeError, match="boom"):
        fusepass.fusepass_backend(None, [])
    assert type(V.choices) is InductorChoices


def test_rocm_follows_inductor(stock_says_7, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert DecodeReductionChoices.reduction_split_factor(CUDA, 14336, 1, True) == 7
