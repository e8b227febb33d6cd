"""Inductor's choices while ``backend="fusepass"`` compiles: a decode-size row reduction stays
one kernel.

At a decode size (at most ``DECODE_ROWS`` rows) stock Inductor on an H100/H200 splits a row
reduction over more than 8192 elements into partial reductions, a final one and, for a
quantization, a separate cast: three launches (``InductorChoices.reduction_split_factor``).
A W8A8 Llama MLP's down_proj quantizes a 14336-wide activation per row, so each layer paid two
launches more than it needed, and a default-mode decode step is bound by its launches.
Up to ``MAX_UNSPLIT`` elements (Llama-3-70B's 28672 included)
one program per row reads at most 64 KB of bf16; above it, or with more rows, and on other
devices (ROCm included: not measured there), Inductor's own rule decides. The rows are
Inductor's size hint: a graph with a symbolic M keeps the choice of its example's M.
Forward (inference) graphs only: AOTAutograd compiles a backward at the first
``.backward()``, after the backend's compile has returned, with Inductor's choices.

The fusepass backend compiles inside ``decode_reductions()``. ``FusePass.uuid()`` names the
choices class in force, so Inductor's FX graph cache keeps this code apart from stock
Inductor's (``options=fusepass.inductor_options()`` does not change the choices).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ._compat import InductorChoices, V

log = logging.getLogger(__name__)

DECODE_ROWS = 16
MAX_UNSPLIT = 32768


class DecodeReductionChoices(InductorChoices):
    """Stock Inductor's choices, but a CUDA row reduction of at most ``DECODE_ROWS`` rows of at
    most ``MAX_UNSPLIT`` elements is never split."""

    @staticmethod
    def reduction_split_factor(device, reduction_numel_hint: int, numel_hint: int, inner_reduction: bool) -> int:
        if (device.type == "cuda" and torch.version.hip is None and inner_reduction and numel_hint <= DECODE_ROWS
                and reduction_numel_hint <= MAX_UNSPLIT):
            return 1
        return InductorChoices.reduction_split_factor(device, reduction_numel_hint, numel_hint, inner_reduction)


@contextlib.contextmanager
def decode_reductions(options: dict | None = None):
    """Compile with ``DecodeReductionChoices`` in force, unless a choices handler of the
    caller's own is (set on ``V``, or as ``options["inductor_choices_class"]``: theirs is kept)
    or this torch's Inductor has no split-factor choice."""
    if ((options or {}).get("inductor_choices_class") is not None or type(V.choices) is not InductorChoices
            or not hasattr(InductorChoices, "reduction_split_factor")):
        log.debug("fusepass: Inductor's choices %s kept; decode reductions split as they decide",
                  type(V.choices).__name__)
        yield
        return
    with V.set_choices_handler(DecodeReductionChoices()):
        yield
