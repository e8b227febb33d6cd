"""benchmarks/bench_decode_step.py: its arguments, its table, the kernel families, and a CPU
smoke run of the real path (the profiler's CUDA counts need a GPU)."""

import json

import pytest
from torch._dynamo.utils import counters

from tests.support.bench_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_decode_step")


@pytest.mark.parametrize("name, family", [
    ("scaled_mm_kernel", "gemm"), ("scaled_gemv_kernel_0", "gemm"), ("scaled_mm_group_kernel", "gemm"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNN", "gemm"),
    ("pytorch_flash::flash_fwd_kernel", "attention"), ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("triton_red_fused_abs_amax_clamp_div_0", "amax/clamp"), ("triton_poi_fused__to_copy_clamp_div_round_1", "amax/clamp"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "zeros/fill"),
    ("triton_poi_fused_add_mul_rsqrt_2", "other"),
])
def test_kernel_families(bench, name, family):
    assert bench.kernel_family(name) == family


def test_table_against_bf16_round_by_round(bench):
    result = {"gpu": "NVIDIA H200", "batch": 1, "split_outside_graphs": False, "rows": {
        "bf16": {"step_ms": [1.6, 2.0], "kernels": 108.0, "gpu_ms": 0.673, "profiled_host_ms": 2.1},
        "int8-handwritten": {"step_ms": [1.92, 2.2], "kernels": 104.0, "gpu_ms": 0.619, "profiled_host_ms": 2.4}}}
    assert bench.table(result).splitlines()[-1] == "| int8-handwritten | 1.92 / 2.20 | 1.20 / 1.10 | 104.0 | 0.619 | 2.4 |"


@pytest.mark.parametrize("argv, message", [
    (["--variants", "bf16,int4"], "--variants: unknown ['int4']"),
    (["--device", "cpu", "--variants", "fp8"], "the fp8 variants need a CUDA GPU"),
    (["--device", "cpu", "--rounds", "0"], "must be >= 1"),
    (["--device", "cpu", "--profile-dir", "/no/such/dir"], "--profile-dir /no/such/dir: no such directory"),
])
def test_bad_arguments(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_cpu_run_fuses_and_times(bench, tmp_path, capsys):
    counters["fusepass"].clear()
    out = tmp_path / "r.json"
    assert bench.main(["--device", "cpu", "--variants", "bf16,int8-handwritten", "--rounds", "1", "--steps", "1",
                       "--out", str(out), "--profile-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["gpu"] == "CPU" and list(result["rows"]) == ["bf16", "int8-handwritten"]
    for name, row in result["rows"].items():
        assert len(row["step_ms"]) == 1 and row["step_ms"][0] > 0 and row["profiled_host_ms"] > 0
        assert "Self CPU" in (tmp_path / f"profile-{name}.txt").read_text()
    # every linear of the 1-layer model (7 and lm_head) fused; q/k/v one group, gate/up another;
    # o_proj's and down_proj's rows quantized in their launches (default mode)
    assert dict(counters["fusepass"]) == {"int_mm_scaled": 8, "scaled_mm_group": 2, "quantized_in_gemv": 2}
    assert "CPU timings" in capsys.readouterr().out
