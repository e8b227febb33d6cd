"""torch.library.opcheck on every op: schema, fake impl vs real impl, dynamic shapes."""

import pytest
import torch

from tests.support.helpers import make_problem

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _noncontiguous(p):
    p.a = torch.cat([p.a, p.a], dim=1)[:, ::2]  # stride (2K, 2)
    p.scale_a = torch.cat([p.scale_a, p.scale_a], dim=1)[:, :1]  # [M, 1] with stride 2
    return p


def _bf16_scales(p):
    p.scale_a, p.scale_b = p.scale_a.bfloat16(), p.scale_b.bfloat16()  # (torchao's weight scales)
    return p


CASES = {
    "M0": lambda d: make_problem(0, 24, 40, device=d, bias_dtype=torch.float32),
    "decode": lambda d: make_problem(1, 24, 40, device=d, sa_shape=(), sb_shape=(24,)),
    "ragged": lambda d: make_problem(33, 17, 100, device=d, bias_dtype=torch.bfloat16),
    "noncontiguous": lambda d: _noncontiguous(make_problem(9, 24, 40, device=d)),
    "bf16_scales": lambda d: _bf16_scales(make_problem(5, 24, 40, device=d)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_opcheck_scaled_mm(device, case, dtype):
    p = CASES[case](device)
    if dtype != torch.int8:
        p.a, p.b = p.a.to(dtype), p.b.to(dtype)
    args = (p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.bias)
    utils = ALL_UTILS
    if dtype != torch.int8:
        # test_schema compares inputs with arithmetic that CPU fp8 lacks ("mul_cpu_reduced_float"
        # not implemented for Float8_e4m3fn); the int8 cases check the schema.
        utils = tuple(u for u in ALL_UTILS if u != "test_schema")
    torch.library.opcheck(torch.ops.fusepass.scaled_mm.default, args, test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("azp", ["tensor", "token"])
def test_opcheck_scaled_mm_azp(device, case, azp):
    p = CASES[case](device)
    (M, K), N = p.a.shape, p.b.shape[1]
    q = make_problem(M, N, K, device=device, azp=azp)
    args = (p.a, p.b, p.scale_a, p.scale_b, torch.float16, q.azp_adj, q.azp, p.bias)
    torch.library.opcheck(torch.ops.fusepass.scaled_mm_azp.default, args)
