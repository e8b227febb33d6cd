"""benchmarks/bench_linear.py's summary (the timing itself needs a GPU): decode held to the
measured read bandwidth where a result has it, and beside bf16's own bytes per second."""

import pytest

from tests.support.bench_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_linear")


def _rows():
    # N * K = 2**24 weights: int8 reads 16.8 MB, bf16 33.6 MB.
    return [{"M": 1, "N": 4096, "K": 4096, "us": {"fusepass int8": 5.0, "bf16 F.linear": 10.0}},
            {"M": 1, "N": 1024, "K": 16384, "us": {"fusepass int8": 8.0, "bf16 F.linear": 12.0}}]


def test_decode_against_read_bandwidth_and_bf16(bench):
    ceil = {"copy_TBps": 2.7, "read_TBps": 4.0, "int8_TOPS": 1000.0, "fp8_TFLOPS": 1400.0, "bf16_TFLOPS": 760.0}
    (line,) = bench.summarize({"rows": _rows(), "ceilings": ceil})
    assert line == ("int8, M=1: weight read 2.10-3.36 TB/s = 52%-84% of read bandwidth 4.00 (target 85%); "
                    "bf16 F.linear reads 2.80-3.36 TB/s; 1.50-2.00x bf16 F.linear (target 1.8x)")
    assert bench.floor_us("int8", 1, 4096, 4096, ceil) == pytest.approx((2**24 + 4096 + 4 * 4097 + 2 * 4096 * 2) / 4e6)


def test_older_results_fall_back_to_copy_bandwidth(bench):
    (line,) = bench.summarize({"rows": _rows(), "ceilings": {"copy_TBps": 2.7}})
    assert "of copy bandwidth 2.70 (target 75%)" in line


def test_fp8_op_and_its_kernel_alone_against_cublas(bench):
    rows = [{"M": M, "N": 4096, "K": 4096, "us": {"fp8 torch._scaled_mm": 10.0, "fusepass fp8": us, bench.KERNEL_FP8: kernel}}
            for M, us, kernel in ((64, 8.0, None), (256, 10.0, 12.5), (4096, 10.0, 20.0))]
    lines = bench.summarize({"rows": rows, "ceilings": {"read_TBps": 4.0}})
    assert lines == [
        "fp8, M>=64: geomean 1.08x torch._scaled_mm (target 1.05x), min 1.00x (target 0.95x)",
        f"fp8 Triton kernel alone (the op runs cuBLAS above M = {bench.FP8_CUBLAS_ABOVE_M}), M>=64: geomean 0.63x "
        "torch._scaled_mm, min 0.50x",
    ]


def test_the_kernel_row_only_where_the_op_runs_cublas(bench, monkeypatch):
    monkeypatch.setattr(bench, "_fp8_on_cublas", lambda: True)
    assert bench.KERNEL_FP8 not in bench.implementations(bench.FP8_CUBLAS_ABOVE_M)
    assert bench.KERNEL_FP8 in bench.implementations(bench.FP8_CUBLAS_ABOVE_M + 1)
    monkeypatch.setattr(bench, "_fp8_on_cublas", lambda: False)  # another GPU: the op is the kernel
    assert bench.KERNEL_FP8 not in bench.implementations(bench.FP8_CUBLAS_ABOVE_M + 1)


def test_a_points_implementations_take_turns_and_report_their_medians(bench, monkeypatch):
    turns, rests = [], []
    monkeypatch.setattr(bench.time, "sleep", rests.append)

    class Fake:  # stands in for a captured CUDA graph: each turn's replays cost its base + the turn's drift
        n_copies = 2

        def __init__(self, name, base):
            self.name, self.base = name, base

        def times_us(self, replays):
            turns.append((self.name, replays))
            return [self.base + len(turns) + i for i in range(replays)]

    us = bench.interleaved_us({"a": Fake("a", 100.0), "b": Fake("b", 100.0), "c": Fake("c", 200.0)})
    per_turn = bench.REPLAYS // bench.ROUNDS
    assert [name for name, _ in turns] == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c", "b", "c", "a"]
    assert {n for _, n in turns} == {per_turn}
    # a drift that grows through the point reaches equal implementations alike (timed one
    # after the other, b would have come out 5 turns' drift slower than a)
    assert abs(us["a"] - us["b"]) <= 1 and us["c"] - us["a"] == pytest.approx(100.0, abs=2)
    expected_a = sorted(100 + t + 1 + i for t, (name, _) in enumerate(turns) if name == "a" for i in range(per_turn))
    assert us["a"] == expected_a[len(expected_a) // 2]
    # after each turn the GPU idles as long as the turn ran (REST = 1): 2 calls a replay
    first_turn_s = 2 * sum(101 + i for i in range(per_turn)) / 1e6
    assert len(rests) == len(turns) and rests[0] == pytest.approx(bench.REST * first_turn_s)
    assert bench.interleaved_us({}) == {}  # every implementation of the point failed


def test_a_replay_that_fails_leaves_the_rotation(bench, monkeypatch):
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)

    class Fake:
        n_copies = 1

        def __init__(self, fails):
            self.fails, self.turns = fails, 0

        def times_us(self, replays):
            self.turns += 1
            if self.fails:
                raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
            return [10.0] * replays
    logged, good, bad = [], Fake(False), Fake(True)
    assert bench.interleaved_us({"good": good, "bad": bad}, logged.append) == {"good": 10.0, "bad": None}
    assert (good.turns, bad.turns) == (bench.ROUNDS, 1)
    assert logged == ["  bad: replay failed: CUDA error: an illegal memory access was encountered"]


def test_int8_against_its_targets_and_the_fp8_peak(bench):
    rows = [{"M": M, "N": 4096, "K": 4096, "us": {"fusepass int8": us, "int8 torch.compile": 2 * us, "fp8 torch._scaled_mm": fp8}}
            for M, us, fp8 in ((1024, 40.0, 30.0), (4096, 100.0, 110.0), (16384, 400.0, 400.0))]
    ceil = {"read_TBps": 4.0, "int8_TOPS": 950.0, "fp8_TFLOPS": 1450.0, "bf16_TFLOPS": 780.0}
    lines = bench.summarize({"rows": rows, "ceilings": ceil})
    assert lines[:2] == [
        "int8, M>=64: geomean 2.00x torch.compile (target 1.35x), min 2.00x (target 1.0x); M>=4096: 1374-1374 TOPS (target 1400)",
        "int8, M>=1024: 0.75-1.10x fp8 torch._scaled_mm, the same tensor-core peak (target >= 1.0x at every point: 2 of 3)",
    ]
    # int8's compute floor is the faster of the two measured peaks (Hopper: one tensor-core rate)
    assert bench.floor_us("int8", 16384, 4096, 4096, ceil) == pytest.approx(2 * 16384 * 4096 * 4096 / 1450e6)
