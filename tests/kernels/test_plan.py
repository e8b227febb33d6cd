"""``launch.plan``: which kernel, grid and constexprs a config gets for given operands, decided
without launching or allocating (fake CUDA tensors on a pretend sm90 GPU of Hopper's SMs and
shared memory, whatever GPU the host has, if any)."""

from dataclasses import replace

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fusepass.kernels import launch
from fusepass.kernels.configs import DEFAULT_SMS, Config
from fusepass.kernels.persistent import scaled_mm_persistent_kernel
from fusepass.kernels.scaled_mm import scaled_mm_kernel

@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    monkeypatch.setattr(launch, "sm_count", lambda device: DEFAULT_SMS)
    monkeypatch.setattr(launch, "shared_memory", lambda device: launch.HOPPER_SHARED_MEMORY)


FLAGS = dict(SCALE_A_PER_TOKEN=True, SCALE_B_PER_CHANNEL=True, HAS_BIAS=False, AZP=0, RAW_ACC=False)


def _operands(M, N, K, dtype=torch.int8, out_dtype=torch.bfloat16):
    a = torch.empty((M, K), dtype=dtype, device="cuda")
    b = torch.empty((N, K), dtype=dtype, device="cuda").t()  # (K, N), column-major
    return a, b, launch.new_output(a, b, out_dtype)


def test_split_k_plans_the_tile_kernel_with_its_slices(sm90):
    a, b, out = _operands(1, 4096, 14336)
    p = launch.plan(Config(16, 64, 512, split_k=2), FLAGS, a, b, out, fake=True)
    assert p.kernel is scaled_mm_kernel and not p.persistent and not p.tma
    assert p.grid == (4096 // 64, 2) and p.split_k == 2
    assert p.constexprs == {**FLAGS, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 512, "GROUP_M": 8, "num_warps": 4,
                            "num_stages": 3, "SPLIT_K": 2, "USE_TMA": False, "EVEN_K": True}


def test_ragged_k_is_masked(sm90):
    a, b, out = _operands(5, 64, 100)
    assert launch.plan(Config(16, 64, 64), FLAGS, a, b, out, fake=True).constexprs["EVEN_K"] is False


PERSISTENT = Config(128, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)


def test_persistent_plan_takes_one_program_per_tile_up_to_the_sms(sm90):
    a, b, out = _operands(256, 512, 4096)
    p = launch.plan(PERSISTENT, FLAGS, a, b, out, fake=True)
    assert p.kernel is scaled_mm_persistent_kernel and p.tma and p.grid == (2 * 4,) and p.split_k == 1
    assert p.constexprs["NUM_SMS"] == DEFAULT_SMS and "SPLIT_K" not in p.constexprs
    a, b, out = _operands(8192, 8192, 4096)
    assert launch.plan(PERSISTENT, FLAGS, a, b, out, fake=True).grid == (DEFAULT_SMS,)


def test_persistent_plan_with_a_symbolic_m_launches_one_program_per_sm():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    M = mode.from_tensor(torch.empty(64, 4096, dtype=torch.int8), symbolic_context=dynamic).shape[0]
    with mode:
        a = torch.empty((M, 4096), dtype=torch.int8, device="cuda")
        b = torch.empty((512, 4096), dtype=torch.int8, device="cuda").t()
        p = launch.plan(PERSISTENT, FLAGS, a, b, launch.new_output(a, b, torch.bfloat16), fake=True)
    assert p.persistent and p.grid == (DEFAULT_SMS,)  # (64 rows would be 4 tiles)


def test_persistent_falls_back_to_the_tile_kernel(sm90):
    a, b, out = _operands(256, 512, 4096)
    # a strided a: no TMA loads, so no persistent kernel: the tile kernel with pointer loads
    strided = torch.empty_strided((256, 4096), (8192, 2), dtype=torch.int8, device="cuda")
    p = launch.plan(PERSISTENT, FLAGS, strided, b, out, fake=True)
    assert p.kernel is scaled_mm_kernel and not p.tma and p.constexprs["USE_TMA"] is False
    # split along K: the tile kernel with TMA loads
    p = launch.plan(replace(PERSISTENT, split_k=2), FLAGS, a, b, out, fake=True)
    assert p.kernel is scaled_mm_kernel and p.tma and p.grid == (2 * 4, 2)


@pytest.mark.parametrize("out_dtype, stages", [(torch.bfloat16, 4), (torch.float32, 3)])
def test_persistent_plan_fits_its_stages_beside_the_store_buffer(sm90, out_dtype, stages):
    a, b, out = _operands(1024, 1024, 4096, out_dtype=out_dtype)
    big = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    assert launch.plan(big, FLAGS, a, b, out, fake=True).constexprs["num_stages"] == stages
