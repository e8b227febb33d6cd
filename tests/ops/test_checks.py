"""Every bad input raises before any kernel runs, naming the argument, expected vs got."""

import re

import pytest
import torch

import fusepass
from fusepass.ops import checks
from tests.support.helpers import make_problem

M, N, K = 4, 8, 16
F32, BF16 = torch.float32, torch.bfloat16


def _args(**override):
    """scaled_mm_azp-style argument dict of a valid per-token azp problem, then overrides."""
    p = make_problem(M, N, K, azp="token", bias_dtype=F32)
    args = dict(a=p.a, b=p.b, scale_a=p.scale_a, scale_b=p.scale_b, out_dtype=BF16,
                azp_adj=p.azp_adj, azp=p.azp, bias=p.bias)
    args.update(override)
    return args


def _scaled_mm(**override):
    a = _args(**override)
    return fusepass.scaled_mm(a["a"], a["b"], a["scale_a"], a["scale_b"], a["out_dtype"], a["bias"])


def _scaled_mm_azp(**override):
    return fusepass.scaled_mm_azp(**_args(**override))


i8 = lambda *s: torch.zeros(s, dtype=torch.int8)  # noqa: E731
f32 = lambda *s: torch.ones(s)  # noqa: E731

BAD_SCALED_MM = [
    ("a fp16", dict(a=torch.zeros(M, K, dtype=torch.float16)), TypeError,
     "`a` must have dtype int8, float8_e4m3fn; got shape (4, 16), dtype torch.float16"),
    ("a/b mismatch", dict(b=torch.zeros(K, N).to(torch.float8_e4m3fn)), TypeError,
     "`b` must have the dtype of `a` (torch.int8); got shape (16, 8), dtype torch.float8_e4m3fn"),
    ("a 3-D", dict(a=i8(2, M, K)), ValueError, "`a` must be 2-D [M, K]; got shape (2, 4, 16)"),
    ("b 1-D", dict(b=i8(K)), ValueError, "`b` must be 2-D [K, N]; got shape (16,)"),
    ("K mismatch", dict(b=i8(K + 1, N)), ValueError,
     "`b` must be [K, N] with K = 16 (from `a` (4, 16)); got b of shape (17, 8)"),
    ("out int32", dict(out_dtype=torch.int32), TypeError,
     "`out_dtype` must be one of bfloat16, float16, float32; got torch.int32"),
    ("out fp8", dict(out_dtype=torch.float8_e4m3fn), TypeError, "`out_dtype` must be one of"),
    ("scale_a fp64", dict(scale_a=f32(M, 1).double()), TypeError,
     "`scale_a` must have dtype float32, bfloat16, float16; got shape (4, 1), dtype torch.float64"),
    ("scale_a wrong numel", dict(scale_a=f32(M + 1, 1)), ValueError,
     "`scale_a` must hold one value (per-tensor) or one per row of `a` (M = 4): numel 1, or "
     "shape [4, 1] or [4]; got shape (5, 1)"),
    ("scale_a on the wrong axis", dict(scale_a=f32(1, M)), ValueError, "`scale_a` must hold one value"),
    ("scale_a full [M, N]", dict(scale_a=f32(M, N)), ValueError, "`scale_a` must hold one value"),
    ("scale_b per-token shape", dict(scale_b=f32(N, 1)), ValueError,
     "`scale_b` must hold one value (per-tensor) or one per column of `b` (N = 8): numel 1, or "
     "shape [1, 8] or [8]; got shape (8, 1)"),
    ("scale_b fp64", dict(scale_b=f32(N).double()), TypeError, "`scale_b` must have dtype float32"),
    ("bias shape", dict(bias=f32(N + 1)), ValueError, "`bias` must be [N] with N = 8; got shape (9,)"),
    ("bias 2-D", dict(bias=f32(1, N)), ValueError, "`bias` must be [N] with N = 8; got shape (1, 8)"),
    ("bias int", dict(bias=torch.zeros(N, dtype=torch.int32)), TypeError,
     "`bias` must have dtype bfloat16, float16, float32; got shape (8,), dtype torch.int32"),
    ("device mismatch", dict(scale_b=torch.ones(N, device="meta")), ValueError,
     "all tensors must be on one device; `a` is on cpu but `scale_b` is on meta"),
    ("bias device", dict(bias=torch.ones(N, device="meta")), ValueError, "but `bias` is on meta"),
    ("out str", dict(out_dtype="bfloat16"), TypeError,
     "`out_dtype` must be one of bfloat16, float16, float32; got 'bfloat16' (str, not a torch.dtype)"),
]

BAD_AZP = [
    ("fp8 a", dict(a=torch.zeros(M, K).to(torch.float8_e4m3fn), b=torch.zeros(K, N).to(torch.float8_e4m3fn)),
     TypeError, "fusepass.scaled_mm_azp: `a` must have dtype int8; got shape (4, 16), dtype torch.float8_e4m3fn"),
    ("azp_adj shape", dict(azp_adj=torch.zeros(N + 1, dtype=torch.int32)), ValueError,
     "`azp_adj` must be [N] or [1, N] with N = 8; got shape (9,)"),
    ("azp_adj dtype", dict(azp_adj=torch.zeros(N, dtype=torch.int16)), TypeError,
     "`azp_adj` must have dtype int32, int64, float32; got shape (8,), dtype torch.int16"),
    ("azp_adj missing", dict(azp_adj=None), TypeError, "`azp_adj` must be a torch.Tensor, got NoneType"),
    ("azp shape", dict(azp=torch.zeros(N, dtype=torch.int32)), ValueError,
     "`azp` (per-token zero point) must be [M] or [M, 1] with M = 4; got shape (8,)"),
    ("azp dtype", dict(azp=torch.zeros(M, dtype=torch.int8)), TypeError,
     "`azp` must have dtype int32, int64, float32; got shape (4,), dtype torch.int8"),
    ("azp device", dict(azp=torch.zeros(M, dtype=torch.int32, device="meta")), ValueError,
     "but `azp` is on meta"),
    ("scale_a numel", dict(scale_a=f32(2)), ValueError, "`scale_a` must hold one value"),
    ("out str", dict(out_dtype="float16"), TypeError,
     "fusepass.scaled_mm_azp: `out_dtype` must be one of bfloat16, float16, float32; got 'float16' (str, not a torch.dtype)"),
]


@pytest.mark.parametrize("name,override,exc,message", BAD_SCALED_MM, ids=[c[0] for c in BAD_SCALED_MM])
def test_scaled_mm_rejects(name, override, exc, message):
    with pytest.raises(exc, match="^fusepass.scaled_mm: .*" + re.escape(message)):
        _scaled_mm(**override)


@pytest.mark.parametrize("name,override,exc,message", BAD_AZP, ids=[c[0] for c in BAD_AZP])
def test_scaled_mm_azp_rejects(name, override, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        _scaled_mm_azp(**override)


@pytest.mark.parametrize("name,override,exc,message", BAD_SCALED_MM[:8], ids=[c[0] for c in BAD_SCALED_MM[:8]])
def test_fake_impl_rejects_too(name, override, exc, message):
    """Under torch.compile the fake impl sees the inputs first: same errors at trace time."""
    fake = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _args(**override).items()}
    with pytest.raises(exc, match=re.escape(message.split("; got")[0])):
        torch.ops.fusepass.scaled_mm(fake["a"], fake["b"], fake["scale_a"], fake["scale_b"],
                                     fake["out_dtype"], fake["bias"])


def test_k_too_large_for_int32():
    a = torch.zeros(1, checks.MAX_K_INT8 + 1, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"K = 131072 is too large for exact int32 accumulation .*at most 131071"):
        fusepass.scaled_mm(a, a.t(), f32(1), f32(1), F32)
    a = torch.zeros(1, checks.MAX_K_INT8_AZP + 1, dtype=torch.int8)
    adj = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"K = 65536 is too large .*at most 65535"):
        fusepass.scaled_mm_azp(a, a.t(), f32(1), f32(1), F32, adj)


@pytest.mark.parametrize("cap,dtype,message", [
    ((8, 0), torch.float8_e4m3fn, "float8_e4m3fn inputs need a GPU with compute capability >= 8.9; cuda:0 has 8.0"),
    ((7, 5), torch.int8, "int8 inputs need a GPU with compute capability >= 8.0; cuda:0 has 7.5"),
])
def test_unsupported_gpus(monkeypatch, cap, dtype, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    checks._capability.cache_clear()
    with pytest.raises(ValueError, match=re.escape("fusepass.scaled_mm: " + message)):
        checks.check_gpu("fusepass.scaled_mm", torch.device("cuda", 0), dtype)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    checks._capability.cache_clear()
    checks.check_gpu("fusepass.scaled_mm", torch.device("cuda", 0), dtype)
    checks._capability.cache_clear()


def test_valid_inputs_pass():
    assert _scaled_mm().shape == (M, N)
    assert _scaled_mm_azp().shape == (M, N)
