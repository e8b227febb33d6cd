"""benchmarks/bench_blockwise.py: its --smoke run (every path a GPU run takes, with a wall-clock
timer instead of CUDA graphs; on a CPU the kernel runs in Triton's interpreter) and its summary."""

import json

import pytest
import torch

from tests.support.bench_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_blockwise")


def test_smoke_run_checks_and_writes_results(bench, tmp_path, capsys):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-blockwise-smoke.json")
    result = json.loads(path.read_text())
    assert result["smoke"] and result["ceilings"] is None
    (row,) = result["rows"]
    assert (row["M"], row["N"], row["K"]) == (4, 200, 300)
    ours = ["fusepass blockwise", "fp8 dequant + bf16 eager", bench.KERNEL]
    for name in ours:
        assert row["us"][name] > 0 and row["rel_err"][name] < 1e-2, name
    assert row["us"]["bf16 F.linear"] > 0
    if not torch.cuda.is_available():  # CPU _scaled_mm has no block-wise mode: reported, not fatal
        assert row["us"]["fp8 torch._scaled_mm block-wise"] is None
        assert "fp8 torch._scaled_mm block-wise at M=4 N=200 K=300 failed" in capsys.readouterr().out


def test_summary_reads_the_crossover(bench):
    def row(M, N, ours, cublas):
        return {"M": M, "N": N, "K": 4096, "us": {"fusepass blockwise": ours, "fp8 torch._scaled_mm block-wise": cublas,
                                                  "fp8 dequant + bf16 eager": 4 * ours}}

    rows = [row(1, 4096, 10, 20), row(1, 8192, 10, 15), row(16, 4096, 10, 12), row(16, 8192, 10, 11),
            row(64, 4096, 10, 9), row(64, 8192, 10, 12), row(256, 4096, 10, 30), row(256, 8192, 10, 30)]
    rows[0]["floor_us"], rows[1]["floor_us"] = {"fp8": 5}, {"fp8": 8}
    lines = bench.summarize({"rows": rows})
    assert lines[:2] == ["M=1: fusepass at 50%-80% of its floor",
                         "M=1: 1.73x cuBLAS block-wise (min 1.50x, max 2.00x); 4.00x the dequantize + bf16 path"]
    # M=64 is slower at one shape: the crossover is 16 although M=256 is faster again.
    assert lines[-1].startswith("fused faster than cuBLAS at every shape for every M up to 16 ")


def test_summary_without_cublas_at_m1_and_no_crossover(bench):
    """As on torch 2.11: cuBLAS refuses M = 1, and is faster somewhere at M = 16."""
    def row(M, N, ours, cublas):
        return {"M": M, "N": N, "K": 4096, "us": {"fusepass blockwise": ours, "fp8 torch._scaled_mm block-wise": cublas,
                                                  "fp8 dequant + bf16 eager": 2 * ours}}

    rows = [row(1, 4096, 10, None), row(16, 4096, 10, 9), row(16, 8192, 10, 20), row(64, 4096, 10, 20)]
    lines = bench.summarize({"rows": rows})
    assert lines[0] == "M=1: cuBLAS block-wise did not run; 2.00x the dequantize + bf16 path"
    assert lines[-1].startswith("fused faster than cuBLAS at every shape at no M: cuBLAS is faster at some shape at M = 16 ")
    rows[1] = row(16, 4096, 10, 11)  # now faster at M = 16 and 64: M = 1 does not break the chain
    assert bench.summarize({"rows": rows})[-1].startswith("fused faster than cuBLAS at every shape for every M up to 64 ")
    # cuBLAS missing at M = 16, after it ran at M = 1: the run ends at 1, not at 64
    gap = [row(1, 4096, 10, 20), row(16, 4096, 10, None), row(64, 4096, 10, 20)]
    assert bench.summarize({"rows": gap})[-1].startswith("fused faster than cuBLAS at every shape for every M up to 1 ")


def test_real_run_needs_a_gpu(bench):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "8b"])


def test_summary_crossover_is_the_kernels(bench):
    """With the Triton kernel's own row, the crossover is the kernel's (the op runs cuBLAS's
    GEMM at large M, so its own row ties cuBLAS there)."""
    def row(M, ours, kernel, cublas):
        return {"M": M, "N": 4096, "K": 4096, "us": {"fusepass blockwise": ours, bench.KERNEL: kernel,
                                                     "fp8 torch._scaled_mm block-wise": cublas,
                                                     "fp8 dequant + bf16 eager": 3 * ours}}

    lines = bench.summarize({"rows": [row(16, 10, 10, 20), row(1024, 10, 15, 10)]})
    assert lines[:4] == ["M=16: 2.00x cuBLAS block-wise (min 2.00x, max 2.00x); 3.00x the dequantize + bf16 path",
                         "M=16: the Triton kernel alone 2.00x cuBLAS block-wise (min 2.00x, max 2.00x)",
                         "M=1024: 1.00x cuBLAS block-wise (min 1.00x, max 1.00x); 3.00x the dequantize + bf16 path",
                         "M=1024: the Triton kernel alone 0.67x cuBLAS block-wise (min 0.67x, max 0.67x)"]
    assert lines[-1].startswith("fused faster than cuBLAS at every shape for every M up to 16 (on an sm90 GPU "
                                f"the op runs cuBLAS's block-wise GEMM above M = {bench.CUBLAS_ABOVE_M};")


def test_a_gpu_point_times_its_paths_in_turns(bench, monkeypatch):
    # The CUDA-graph path on a CPU: a stand-in graph runs its calls once (each path's check
    # ran before it) and reports made-up times; every path is timed by interleaved_us.
    class FakeGraph:
        def __init__(self, make_call, n_copies):
            self.n_copies, self.us = n_copies, 10.0 * (len(made) + 1)
            made.append(self)
            make_call(0)()

        def times_us(self, replays):
            return [self.us] * replays
    made, turns, real = [], [], bench.bl.interleaved_us

    def interleaved(graphs, log):
        turns.append(list(graphs))
        return real(graphs, log)
    monkeypatch.setattr(bench.bl, "Graph", FakeGraph)
    monkeypatch.setattr(bench.bl, "interleaved_us", interleaved)
    monkeypatch.setattr(bench.bl.time, "sleep", lambda s: None)
    ceil = {"read_TBps": 4.0, "fp8_TFLOPS": 1400.0, "int8_TOPS": 950.0, "bf16_TFLOPS": 780.0}
    impls = bench.implementations(False, "cpu")
    logged = []
    row = bench.bench_point(4, 200, 300, impls, "cpu", ceil, 0, logged.append)
    assert list(row["us"]) == list(impls)  # the table's column order
    timed = [name for name in impls if row["us"][name] is not None]
    assert turns == [timed] and len(made) == len(timed)
    assert {"bf16 F.linear", "fp8 dequant + bf16 eager", "fusepass blockwise"} <= set(timed)
    assert [row["us"][name] for name in timed] == [g.us for g in made]
    # CPU _scaled_mm has no block-wise mode: that path failed its check, untimed, reported
    assert row["us"]["fp8 torch._scaled_mm block-wise"] is None
    assert any("fp8 torch._scaled_mm block-wise at M=4 N=200 K=300 failed" in line for line in logged)
