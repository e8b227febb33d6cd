"""``fusepass._compat``: Inductor's analysis of a fused GEMM launch runs once per kernel
signature, not once per call site; every other kernel's analysis is left as it is."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops import triton_kernel_wrap as wrap

from fusepass import _compat
from fusepass.kernels import KERNELS, scaled_mm_kernel


class Counting:
    def __init__(self):
        self.calls = []

    def __call__(self, kernel, kwargs, tma):
        self.calls.append(kwargs)
        return ["out_ptr"]


def _args(dtype=torch.int8, M=1, **extra):
    return {"a_ptr": torch.empty(2, dtype=dtype, device="meta"), "M": M, "BLOCK_M": 16, "bias_ptr": None, **extra}


def test_one_analysis_per_signature():
    inner = Counting()
    memo = _compat._memoized(inner, frozenset(KERNELS))
    first = memo(scaled_mm_kernel, _args(), {})
    assert first == ["out_ptr"]
    first.append("changed by a caller")  # (each site gets its own list)
    assert memo(scaled_mm_kernel, _args(), {}) == ["out_ptr"]  # another tensor, same signature
    assert len(inner.calls) == 1
    memo(scaled_mm_kernel, _args(torch.float8_e4m3fn), {})  # another dtype
    memo(scaled_mm_kernel, _args(M=16), {})  # another size (Triton specializes on it)
    memo(scaled_mm_kernel, _args(M=32), {})
    assert len(inner.calls) == 4


def test_symbolic_sizes_share_an_analysis():
    import sympy

    inner = Counting()
    memo = _compat._memoized(inner, frozenset(KERNELS))
    memo(scaled_mm_kernel, _args(M=sympy.Symbol("s0")), {})
    memo(scaled_mm_kernel, _args(M=sympy.Symbol("s1") * 2), {})
    assert len(inner.calls) == 1  # (the IR takes any symbolic size as the same placeholder)


@pytest.mark.parametrize("kernel, args, tma", [
    ("another kernel", _args(), {}),  # not ours: analysed as before
    (scaled_mm_kernel, _args(extra=[1, 2]), {}),  # an unhashable argument
    (scaled_mm_kernel, _args(), {"a_ptr": ("stable", ([16, 16],))}),  # a TMA descriptor argument
])
def test_left_alone(kernel, args, tma):
    inner = Counting()
    memo = _compat._memoized(inner, frozenset(KERNELS))
    memo(kernel, args, tma)
    memo(kernel, args, tma)
    assert len(inner.calls) == 2


def test_installed_once_on_this_torch(monkeypatch):
    name = next(n for n in _compat._ANALYSES if hasattr(wrap, n))
    original = getattr(wrap, name)
    monkeypatch.setattr(wrap, name, getattr(original, "__wrapped__", original))
    assert _compat.memoize_kernel_analysis(KERNELS)
    installed = getattr(wrap, name)
    assert installed.__wrapped__ is getattr(original, "__wrapped__", original)
    assert installed.fusepass_kernels == frozenset(KERNELS)
    assert _compat.memoize_kernel_analysis(KERNELS[:1]) and getattr(wrap, name) is installed  # idempotent


def test_a_torch_without_the_analysis(monkeypatch):
    for name in _compat._ANALYSES:
        monkeypatch.delattr(wrap, name, raising=False)
    assert not _compat.memoize_kernel_analysis(KERNELS)


# ATen ops a user's graph holds (the pass matches them), not internals.
OPS = {"_scaled_mm", "_int_mm"}


def _private_uses(path) -> list[str]:
    """Imports of, and attribute chains into, torch's and Triton's underscore-named parts."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and node.attr == "_schema":  # (of an op, whatever its name)
            names = ["torch._schema"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        for name in names:
            parts = name.split(".")
            if parts[0] in ("torch", "triton") and any(p.startswith("_") and p not in OPS for p in parts[1:]):
                found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_private_names_live_in_compat_only():
    from pathlib import Path

    package = Path(_compat.__file__).parent
    found = [use for path in sorted(package.rglob("*.py")) if path.name != "_compat.py" for use in _private_uses(path)]
    assert found == [], found
    assert _private_uses(Path(_compat.__file__))  # (the check sees them where they are)


@pytest.mark.parametrize("torch_version, triton_version, untested", [
    ("2.11.0+cu130", "3.6.0", []),
    ("2.13.0+cpu", "3.9.0", []),
    ("2.14.0", "3.6.0", ["torch 2.14.0"]),
    ("2.10.1", "3.10.0", ["torch 2.10.1", "triton 3.10.0"]),
])
def test_untested_versions_are_named(monkeypatch, caplog, torch_version, triton_version, untested):
    import logging

    import triton

    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(triton, "__version__", triton_version)
    assert _compat.untested_versions() == untested
    with caplog.at_level(logging.WARNING, logger="fusepass"):
        _compat.warn_untested()
    assert bool(caplog.records) == bool(untested)
    if untested:
        assert "tested on torch 2.11-2.13 and Triton 3.6-3.9" in caplog.text and untested[0] in caplog.text


def test_an_autotuners_analysis_is_its_own():
    """An Autotuner over a kernel adds its first config's values to the IR: not the plain
    kernel's entry."""
    class Autotuner:
        fn = scaled_mm_kernel

    inner = Counting()
    memo = _compat._memoized(inner, frozenset(KERNELS))
    memo(scaled_mm_kernel, _args(), {})
    memo(Autotuner(), _args(), {})
    assert len(inner.calls) == 2


def test_someone_elses_wrapper_is_kept(monkeypatch):
    import functools

    name = next(n for n in _compat._ANALYSES if hasattr(wrap, n))
    base = getattr(wrap, name)
    base = getattr(base, "__wrapped__", base) if hasattr(base, "fusepass_kernels") else base

    @functools.wraps(base)
    def theirs(*args):
        return base(*args)

    monkeypatch.setattr(wrap, name, theirs)
    assert _compat.memoize_kernel_analysis(KERNELS)
    assert getattr(wrap, name).__wrapped__ is theirs


@pytest.mark.parametrize("text, version", [("2.11.0+cu130", (2, 11)), ("3.6rc1", (3, 6)), ("nightly", (0, 0))])
def test_version_strings(text, version):
    assert _compat._version(text) == version
