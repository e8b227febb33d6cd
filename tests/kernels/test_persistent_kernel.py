"""The persistent kernel (``fusepass/kernels/persistent.py``; Triton's interpreter on CPU,
the GPU when there is one) against the ops' CPU reference, and where ``launch`` runs it
instead of ``scaled_mm_kernel``."""

import json

import pytest
import torch

from fusepass.kernels import configs, launch, launch_scaled_mm
from fusepass.kernels.configs import Config
from fusepass.kernels.persistent import scaled_mm_persistent_kernel
from fusepass.kernels.scaled_mm import scaled_mm_kernel
from tests.support.helpers import assert_matches_oracle, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PERSISTENT = Config(16, 32, 32, tma=True, persistent=True)


@pytest.fixture
def launched(monkeypatch):
    """The kernels ``launch`` launches, in order."""
    kernels, real = [], launch.launcher

    def spy(kernel, fake):
        kernels.append(kernel)
        return real(kernel, fake)
    monkeypatch.setattr(launch, "launcher", spy)
    return kernels


@pytest.fixture(params=[2, None], ids=["2_programs", "one_per_sm"])
def sms(request, monkeypatch):
    """2 programs: each walks several tiles (the tile loop); None: the device's SM count."""
    if request.param is not None:
        monkeypatch.setattr(launch, "sm_count", lambda device: request.param)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M,N,K", [(1, 24, 48), (33, 48, 256), (70, 136, 320)])
@pytest.mark.parametrize("scales", ["per_row", "per_tensor"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_persistent_kernel(dtype, M, N, K, scales, out_dtype, sms, launched):
    shapes = {} if scales == "per_row" else dict(sa_shape=(), sb_shape=())
    p = make_problem(M, N, K, dtype, device=DEVICE, bias_dtype=torch.float32, **shapes)
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias, config=PERSISTENT)
    assert launched == [scaled_mm_persistent_kernel]
    # the interpreter rounds fp32 -> bf16 toward zero: one bf16 ulp (as test_scaled_mm_kernel)
    ulps = 1.0 if DEVICE == "cpu" and out_dtype == torch.bfloat16 else 0.0
    assert_matches_oracle(out, p, out_dtype, extra_ulps=ulps)


@pytest.mark.parametrize("azp", ["tensor", "token"])
def test_persistent_kernel_azp(azp, sms, launched):
    p = make_problem(70, 136, 320, device=DEVICE, azp=azp, bias_dtype=torch.float32)
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, p.azp_adj, p.azp, config=PERSISTENT)
    assert launched == [scaled_mm_persistent_kernel]
    assert_matches_oracle(out, p, torch.float32)


def test_persistent_kernel_raw_accumulator_is_exact(sms, launched):
    p = make_problem(70, 136, 320, device=DEVICE)
    acc = launch_scaled_mm(p.a, p.b, None, None, torch.int32, config=PERSISTENT)
    assert launched == [scaled_mm_persistent_kernel]
    assert torch.equal(acc.double(), p.a.double() @ p.b.double())


# TMA cannot write 12 bf16 (24 bytes) rows, nor read 40-byte ones; a split and pointer loads
# are scaled_mm_kernel's alone. The same tiles run there. (N, K, config)
FALLBACKS = {
    "output_rows": (12, 64, PERSISTENT),
    "operand_rows": (48, 40, PERSISTENT),
    "split": (48, 64, Config(16, 32, 32, split_k=2, tma=True, persistent=True)),
    "no_tma": (48, 64, Config(16, 32, 32, persistent=True)),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_falls_back_to_the_tile_kernel(case, launched):
    N, K, cfg = FALLBACKS[case]
    p = make_problem(33, N, K, device=DEVICE, bias_dtype=torch.float32)
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.bias, config=cfg)
    assert launched == [scaled_mm_kernel]
    assert_matches_oracle(out, p, torch.bfloat16, extra_ulps=1.0 if DEVICE == "cpu" else 0.0)


def test_stages_fit_beside_the_store_buffer(monkeypatch):
    # H200: 227 KB a program. 256x128x128 int8 tiles take 48 KB a stage; the half-tile store
    # buffer 32 KB in bf16, 64 KB in fp32: 4 stages fit with the one, 3 with the other.
    monkeypatch.setattr(launch, "shared_memory", lambda device: 232448)
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm90")
    big = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    assert launch.persistent_stages(big, 2, torch.device("cuda")).num_stages == 4
    assert launch.persistent_stages(big, 4, torch.device("cuda")).num_stages == 3
    assert launch.persistent_stages(Config(128, 128, 128, num_stages=4, tma=True, persistent=True), 4,
                                    torch.device("cuda")).num_stages == 4
    assert launch.persistent_stages(Config(256, 256, 256, num_stages=4), 4, torch.device("cuda")) is None  # 2 don't fit
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm89")  # (mma.sync: a buffer fewer than the stages)
    assert launch.persistent_stages(big, 4, torch.device("cuda")).num_stages == 4
    monkeypatch.undo()
    assert launch.shared_memory(torch.device("cpu")) == float("inf")  # the interpreter: no limit
    if not torch.cuda.is_available():  # fake CUDA tensors on this host: Hopper's limit
        assert launch.shared_memory(torch.device("cuda")) == launch.HOPPER_SHARED_MEMORY


def test_tiles_that_never_fit_run_on_the_tile_kernel(monkeypatch, launched):
    monkeypatch.setattr(launch, "shared_memory", lambda device: 20000)
    p = make_problem(33, 48, 64, device=DEVICE, bias_dtype=torch.float32)
    cfg = Config(64, 64, 128, num_stages=3, tma=True, persistent=True)  # 2 stages: 32 KB + the store
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, config=cfg)
    assert launched == [scaled_mm_kernel]
    assert_matches_oracle(out, p, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_largest_tiles_run_with_either_output(out_dtype, launched):
    cfg = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    p = make_problem(512, 256, 512, device="cuda", bias_dtype=torch.float32)
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias, config=cfg)
    assert launched == [scaled_mm_persistent_kernel]
    assert_matches_oracle(out, p, out_dtype)


def test_table_rows_ask_for_it_above_pointer_load_buckets(table_dir):
    tuned = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {}, "defaults": {
        f"int8,{configs.bucket_name(b)}": {"config": tuned.as_dict()} for b in range(len(configs.M_BUCKETS))}}))
    for m in (1, 16, 64, 65, 1024, 16384):
        cfg = configs._config(configs.m_bucket(m), 8192, 8192, "int8", "sm90")
        assert cfg.persistent == cfg.tma == (m > configs.POINTER_LOADS_MAX_M)
    assert Config(**{k: v for k, v in tuned.as_dict().items() if k != "persistent"}).persistent is False  # older rows


@pytest.mark.gpu
def test_inductor_launches_it_and_sees_its_stores(monkeypatch):
    # In compiled code Inductor launches the kernel itself and must see the TMA store as the
    # output's write (its mutation analysis of the kernel), or the op returns empty memory.
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(launch, "select_config", lambda *a, **k: Config(128, 128, 128, num_warps=4, num_stages=4,
                                                                        tma=True, persistent=True))
    torch._dynamo.reset()
    p = make_problem(1000, 512, 512, device="cuda", bias_dtype=torch.bfloat16)

    def linear(a, b, sa, sb, bias):
        return torch.ops.fusepass.scaled_mm(a, b, sa, sb, torch.bfloat16, bias).relu()
    out, (code, *_) = run_and_get_code(torch.compile(linear, dynamic=False), p.a, p.b, p.scale_a, p.scale_b, p.bias)
    torch._dynamo.reset()
    assert "scaled_mm_persistent_kernel" in code
    torch.testing.assert_close(out, linear(p.a, p.b, p.scale_a, p.scale_b, p.bias), rtol=0, atol=0)
    assert out.abs().sum() > 0
