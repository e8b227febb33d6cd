"""Random W8A8 problems and the float64 oracle that tests compare against."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from torch.torch_version import TorchVersion

# torch 2.11 has F.scaled_mm, but Dynamo traces it (aten._scaled_mm_v2) from torch 2.12 on:
# on 2.11 it stops at "Attempted to call function marked as skipped" (H200 GPU run, run 15).
COMPILES_F_SCALED_MM = pytest.mark.skipif(TorchVersion(torch.__version__) < "2.12",
                                          reason="Dynamo traces torch.nn.functional.scaled_mm from torch 2.12")

# Relative half-ulp of each output dtype: the op rounds its fp32 result once.
# Hopper fp8 MMAs sum each K block at reduced precision before the fp32 accumulator. Max
# |error| / sum|a*b| over 20 random [32, K] x [K, 64] problems on an H200, ours and
# torch._scaled_mm (cuBLAS, precise accumulation) identical at every K: 8.6e-5 (K=32),
# 1.9e-4 (64), 1.8e-4 (96), 2.6e-4 (128), 1.4e-4 (256), 4.9e-5 (1024); 2.4e-5 at 4096^3.
FP8_MMA_REL = 2.0**-10

HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}

# Inductor's call of torch._scaled_mm (cuBLAS) in its generated code: an extern kernel, or a
# fallback to the aten op.
CUBLAS_CALL = re.compile(r"(?:extern_kernels|aten)\._scaled_mm(?:\.default)?\(")


def require_sm90(what: str) -> None:
    """Skip unless the GPU is an sm90, where the ops hand ``what`` to cuBLAS."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{what} runs on cuBLAS on sm90 only")


def fake_cuda_bias(dtype, offset: int = 0, n: int = 512) -> torch.Tensor:
    """A [n] bias on the device "cuda" (under FakeTensorMode: no GPU needed), ``offset``
    elements past its storage's start (an offset of 1: not 16-byte aligned)."""
    return torch.empty(n + offset, dtype=dtype, device="cuda").as_strided((n,), (1,), offset)


@dataclass
class Problem:
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    bias: torch.Tensor | None = None
    azp_adj: torch.Tensor | None = None
    azp: torch.Tensor | None = None


def random_q(shape, dtype, device="cpu", generator=None) -> torch.Tensor:
    """Random int8 over its whole range, or fp8 e4m3 from a unit normal (never zeros)."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator).to(device)
    return (torch.randn(shape, generator=generator) * 2).to(dtype).to(device)


def scale_shapes(length: int, axis: int):
    """Every accepted scale layout: per-tensor (0-d, [1], [1, 1]) and per-row/column."""
    vector = [(length, 1), (length,)] if axis == 0 else [(1, length), (length,)]
    return [(), (1,), (1, 1)] + vector


def scale(shape, device="cpu", generator=None) -> torch.Tensor:
    return (torch.rand(shape, generator=generator) * 0.02 + 0.001).to(device)


def make_problem(
    M, N, K, dtype=torch.int8, *, sa_shape=None, sb_shape=None, bias_dtype=None,
    azp=None, azp_dtype=torch.int32, device="cpu", seed=0,
) -> Problem:
    """A random problem; ``b`` is ``w.t()`` of a row-major [N, K] weight, as users pass it.

    sa_shape / sb_shape default to per-token [M, 1] / per-channel [1, N]. azp: None,
    "tensor" (azp_adj = z * colsum(b)) or "token" (azp [M], azp_adj = colsum(b)).
    """
    g = torch.Generator().manual_seed(seed)
    a = random_q((M, K), dtype, device, g)
    b = random_q((N, K), dtype, device, g).t()
    sa_shape = (M, 1) if sa_shape is None else sa_shape  # () is a 0-d (per-tensor) scale
    sb_shape = (1, N) if sb_shape is None else sb_shape
    p = Problem(a, b, scale(sa_shape, device, g), scale(sb_shape, device, g))
    if bias_dtype is not None:
        p.bias = torch.randn(N, generator=g).to(bias_dtype).to(device)
    colsum = b.to(torch.int32).sum(0)
    if azp == "tensor":
        p.azp_adj = (7 * colsum).to(azp_dtype)
    elif azp == "token":
        p.azp = torch.randint(-128, 128, (M,), generator=g).to(azp_dtype).to(device)
        p.azp_adj = colsum.to(azp_dtype)
    return p


def oracle(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, error bound scale) in float64 on the problem's device.

    int8 products and their sums are exact in float64 (|acc| < 2**53). ``mag`` bounds the
    magnitude of every term the epilogue adds, for an fp32 rounding-error allowance.
    """
    a, b = p.a.double(), p.b.double()
    acc = a @ b
    mag = a.abs() @ b.abs()
    if p.azp_adj is not None:
        adj = p.azp_adj.double().reshape(1, -1)
        if p.azp is not None:
            adj = p.azp.double().reshape(-1, 1) * adj
        acc = acc - adj
        mag = mag + adj.abs()
    s = p.scale_a.double().reshape(-1, 1) * p.scale_b.double().reshape(1, -1)
    out, mag = acc * s, mag * s
    if p.bias is not None:
        out = out + p.bias.double()
        mag = mag + p.bias.double().abs()
    return out, mag


def assert_matches_oracle(out: torch.Tensor, p: Problem, out_dtype, *, extra_ulps=0.0, oracle=oracle):
    """out is within one rounding to out_dtype (plus fp32 epilogue/accumulation error) of the
    float64 oracle (``oracle(p)``: value, magnitude). extra_ulps widens the allowance by that
    many out_dtype ulps."""
    ref, mag = oracle(p)
    assert out.dtype == out_dtype and out.shape == ref.shape
    K = p.a.shape[1]
    if p.a.dtype == torch.int8:  # exact accumulator; only the fp32 epilogue rounds
        fp32_err = 8 * 2.0**-24 * mag
    else:  # fp32 sums of K products; on GPU, fp8 MMAs add each K block at reduced precision
        fp32_err = max((K + 8) * 2.0**-24, FP8_MMA_REL if out.is_cuda else 0.0) * mag
    # 2**-24 absolute: fp16 subnormals are spaced 2**-24 apart.
    bound = (1 + 2 * extra_ulps) * HALF_ULP[out_dtype] * ref.abs() * 1.001 + fp32_err + 2.0**-24
    err = (out.double() - ref).abs()
    assert not out.isnan().any(), "NaN in output"
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {out.numel()} elements off; worst error "
        f"{float((err - bound).max()):.3g} over the bound, at {bad.nonzero()[0].tolist()}"
    )


# What a launch module asks of the decode split policy, run eagerly, then traced with a static
# and a symbolic M: (fake, symbolic_m) and the split_decode it passes on (policy: split if traced).
SPLIT_REQUESTS = [(False, False), ("select_config", False), (True, False), ("select_config", True),
                  (True, True), ("bucket_choices", True)]


# The per-token recipes' divisors by quantized dtype (torchao's, compressed-tensors', prepare's).
DIVISOR = {torch.int8: 127.5, torch.float8_e4m3fn: 448.0}


def quantized_row_bound(x, s, b, scale_b, ref, bias=None) -> torch.Tensor:
    """Per column (N,), how far the M = 1 kernel quantizing the row ``x`` (1, K) in its launch
    may land from ``ref``, ``quantize_rows`` (scale ``s``) then the kernel. The kernel's scale
    is the IEEE division ``amax / divisor``; eager CUDA multiplies by the reciprocal, an fp32
    rounding apart (measured on an H200: 1 ulp above in 9 rows of 27), so a value whose
    ``x / s`` sits at a rounding tie (a .5: 13 of K = 5000 in one row) may round the other
    way: one step (int8: 1; ``b`` e4m3: the grid's step at that value) of that element's weight
    per column, and the scale's rounding on the sum."""
    v = (x.float() / s).abs().flatten()
    step = torch.ones_like(v) if b.dtype == torch.int8 else \
        torch.exp2(torch.floor(torch.log2(v.clamp(min=2.0**-6))) - 3)  # (e4m3: 3 mantissa bits)
    w = v / step
    tie = ((w - w.floor()) - 0.5).abs() < 1e-4  # (K,)
    steps = (b.float().abs() * (tie * step)[:, None]).sum(0)  # (N,) (CUDA has no abs of e4m3)
    rounding = 1e-6 * (ref.float().abs().flatten() + (0 if bias is None else bias.float().abs().flatten()))
    return s.flatten() * scale_b.float().abs().flatten() * steps + rounding


def quantizing_launch_and_reference(x, b, scale_b, bias=None, gate=None):
    """(out, ref, row, s): the M = 1 kernel quantizing the float row ``x`` (1, K) in its launch
    (given ``gate``, the row ``silu(gate) * x``) to ``b``'s dtype, prepare's recipe; and
    ``ref``, ``quantize_rows`` of that row (its float form ``row``, its scale ``s``) then the
    M = 1 kernel. fp32 outputs, compared by ``quantized_row_bound``."""
    from fusepass.kernels import configs, launch
    from fusepass.ops.dynamic import quantize_rows
    divisor, floor = DIVISOR[b.dtype], torch.finfo(torch.float32).eps
    row = x if gate is None else torch.nn.functional.silu(gate) * x
    q, s = quantize_rows(row, b.dtype, divisor, floor)
    cfg = configs.gemv_config(b.shape[1], b.shape[0], configs.sm_count(x.device), b.dtype)
    return (launch.launch_gemv_quantized(x, b, scale_b, torch.float32, bias, divisor, floor, gate=gate),
            launch.launch_scaled_mm(q, b, s, scale_b, torch.float32, bias, config=cfg), row, s)


def record_split_requests(monkeypatch, module, run, tensors) -> list:
    """``run(*tensors)`` eagerly and traced (fake, symbolic) with ``module``'s
    ``decode_splits``, ``select_config`` and ``bucket_choices`` recorded; M must not be 1
    (a size of 1 traces as a constant)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []
    monkeypatch.setattr(module, "decode_splits", lambda fake, symbolic_m, graphs: seen.append((fake, symbolic_m)) or fake)
    for name in ("select_config", "bucket_choices"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: seen.append((name, a[-1])) or real(*a))
    run(*tensors)
    for mode in ("fake", "symbolic"):
        make_fx(run, tracing_mode=mode)(*tensors)
    return seen


def compiled_decisions(model, inputs: dict) -> tuple[list, dict]:
    """The pass's decisions and counters where ``model(**inputs)`` compiles (the capture
    backend: the graph Inductor would give the pass, no code generation)."""
    from torch._dynamo.utils import counters

    from fusepass.backend import capture_backend
    from fusepass.passes import FusePass

    decisions, pass_ = [], FusePass()
    counters["fusepass"].clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture_backend(lambda gm: decisions.extend(pass_.run(gm.graph))))(**inputs)
    return decisions, dict(counters["fusepass"])


def prepared_step_decisions(model, step: str, batch: int) -> tuple[list, dict]:
    """``fusepass.prepare(model)``, then ``compiled_decisions`` of its ``step`` ("prefill": an
    8-token prompt; "decode": one token against a 16-slot static cache) of ``batch`` rows."""
    import fusepass
    from fusepass.demo import models

    fusepass.prepare(model)
    ids = models.prompt(model, batch, 8, seed=2)
    inputs = dict(input_ids=ids) if step == "prefill" else models.decode_inputs(ids, models.static_cache(model, batch, 16))
    return compiled_decisions(model, inputs)


def recording_launches(monkeypatch, *modules) -> list:
    """``[(kernel, kwargs)]``, each launch through the ``launcher`` of ``modules`` (``direct.launcher``
    imported by name) with every argument by name, as the kernels then run; asserts each launch
    passes every argument: the direct launcher and ``wrap_triton`` bind no defaults (the
    interpreter, which would take one, runs them here)."""
    launches = []

    def naming_all(kernel, fake):
        def run(grid):
            def call(*args, **kwargs):
                names = kernel.arg_names if hasattr(kernel, "arg_names") else kernel.fn.arg_names
                missing = [n for n in names[len(args):] if n not in kwargs]
                assert not missing, f"{kernel.__name__}: {missing} not passed"
                launches.append((kernel, dict(zip(names, args)) | kwargs))
                return kernel[grid](*args, **kwargs)
            return call
        return type("Naming", (), {"__getitem__": lambda self, grid: run(grid)})()

    for module in modules:
        monkeypatch.setattr(module, "launcher", naming_all)
    return launches


def written_arguments(launches: list) -> list[set[str]]:
    """For each ``(kernel, kwargs)`` launch (every argument by name), the arguments Inductor's
    analysis finds the kernel writes: its walk of the kernel's Triton IR
    (``torch._higher_order_ops.triton_kernel_wrap``: ``identify_accessed_tensors``, before torch
    2.10 ``identify_mutated_tensors``; what it cannot analyse it counts as every input
    written). In a subprocess without TRITON_INTERPRET (the interpreter's kernels make no IR),
    for an sm_90 target through a stand-in driver (no GPU needed); tensors by their dtype."""
    import json
    import os
    import subprocess
    import sys

    def described(v):
        if isinstance(v, torch.Tensor):
            return ["tensor", str(v.dtype).removeprefix("torch.")]
        return ["none"] if v is None else ["value", v]

    fns = [getattr(k, "fn", k) for k, _ in launches]
    spec = [[f.__module__, f.__name__, {n: described(v) for n, v in kw.items()}] for f, (_, kw) in zip(fns, launches)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _WRITTEN_SCRIPT], input=json.dumps(spec), capture_output=True,
                         text=True, env=env, check=True).stdout
    return [set(names) for names in json.loads(out.splitlines()[-1])]


_WRITTEN_SCRIPT = """
import json, sys
import torch, triton
from torch._higher_order_ops import triton_kernel_wrap as wrap
from triton.backends.compiler import GPUTarget
import importlib

class Driver:  # (what generate_ttir asks of the active driver)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0
    def get_active_torch_device(self):
        return torch.device("cpu")

triton.runtime.driver.set_active(Driver())
found = []
for module, name, described in json.load(sys.stdin):
    kwargs = {n: torch.empty(64, dtype=getattr(torch, d[1])) if d[0] == "tensor" else None if d[0] == "none" else d[1]
              for n, d in described.items()}
    kernel = getattr(importlib.import_module(module), name)
    if hasattr(wrap, "identify_accessed_tensors"):
        found.append(sorted(d.name for d in wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes))
    else:
        found.append(sorted(wrap.identify_mutated_tensors(kernel, kwargs, {})))
print(json.dumps(found))
"""
