"""benchmarks/bench_grouped.py: its smoke run on CPU (the kernels in Triton's interpreter, every
output checked against its float reference; the tiles each row ran), and its summary."""

import json

import pytest
import torch

from fusepass.kernels.policy import GROUPED_ROWS_MAX_M, grouped_tiles
from tests.support.bench_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_grouped")


def test_smoke_run_checks_every_output_and_names_its_tiles(bench, tmp_path, capsys):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-grouped.json")
    rows = json.loads(path.read_text())["rows"]
    assert {(r["proj"], r["M"], r["impl"]) for r in rows} == {
        (p, M, f"fusepass {d}") for p in ("gate_up", "down") for M in bench.SMOKE_MS for d in ("int8", "fp8")} | {
        ("down", M, bench.GATED) for M in bench.SMOKE_MS}  # (down's rows as gate and up, quantized in the launch)
    assert all(r["rel_err"] < bench.TOL and r["us"] > 0 for r in rows)
    for r in rows:  # the policy's tiles (weights contiguous along K): the row kernel at decode sizes, blocks above
        gated = r["impl"] == bench.GATED
        assert r["tiles"] == str(grouped_tiles(r["M"], r["N"], r["K"], r["E"], contiguous_k=True, quantizing=gated))
        assert r["tiles"].startswith("rows" if r["M"] <= GROUPED_ROWS_MAX_M else "blocks")
    assert "| gate_up | 8 | 96 | 80 | 2 | fusepass int8 |" in capsys.readouterr().out


@pytest.mark.parametrize("I", [40, 96])  # (a ragged row in one piece; 3 pieces of 32)
def test_quantize_times_the_rows_kernel_alone_at_its_defaults_and_swept(bench, I):
    rows = bench.bench_quantize(8, I, 5, "cpu", 0, True, True, log=print)
    p, s, w = bench.QUANTIZE_SWEEP[0]
    assert [(r["proj"], r["M"], r["K"], r["impl"]) for r in rows][:2] == [
        ("quantize", 5, I, bench.QUANTIZED), ("quantize", 5, I, f"{bench.QUANTIZED} at {p}x{s} w{w}")]
    assert all(r["us"] > 0 for r in rows)


def test_quantize_leaves_out_a_launch_whose_output_is_off_and_says_so(bench, monkeypatch):
    monkeypatch.setattr(bench, "quantized_rows", lambda x, dtype, recipe, fake, **kw: (
        torch.zeros(x.shape, dtype=dtype), torch.ones(x.shape[0])))
    said = []
    assert bench.bench_quantize(8, 40, 5, "cpu", 0, True, False, log=said.append) == []
    assert said == ["  quantize_rows at M=5, I=40 failed: its output is off quantize_rows'"]


def test_a_wrong_output_is_an_error(bench):
    with pytest.raises(AssertionError, match="relative error 1 "):
        bench.check(lambda: __import__("torch").zeros(2, 2), lambda: __import__("torch").ones(2, 2))


def test_summary_against_bf16_and_the_fastest_tiles(bench):
    base = {"proj": "down", "E": 128, "K": 768, "N": 2048, "M": 8}
    rows = [{**base, "impl": "fusepass int8", "us": 5.0, "TBps": 2.5, "tiles": "rows 32x256 w4"},
            {**base, "impl": "bf16 torch._grouped_mm", "us": 20.0, "TBps": 1.26, "tiles": None},
            {**base, "impl": bench.SWEPT + "rows 16x256 w2", "us": 4.0, "TBps": 3.1, "tiles": "rows 16x256 w2"},
            {**base, "impl": bench.SWEPT + "rows 64x512 w8", "us": 6.0, "TBps": 2.1, "tiles": "rows 64x512 w8"},
            {**base, "impl": bench.GATED, "us": 8.0, "TBps": 1.6, "tiles": "rows 32x256 w2"},
            {**base, "impl": bench.SWEPT_GATED + "rows 8x256 w4", "us": 10.0, "TBps": 1.3, "tiles": "rows 8x256 w4"},
            {**base, "impl": bench.SWEPT_GATED + "rows 32x256 w2", "us": 7.0, "TBps": 1.8, "tiles": "rows 32x256 w2"}]
    quantize = {**base, "proj": "quantize", "K": 768, "N": 768, "M": 16384, "tiles": None}
    rows += [{**quantize, "impl": bench.QUANTIZED, "us": 30.0, "TBps": 2.1},
             {**quantize, "impl": bench.QUANTIZED + " at 256x16 w4", "us": 26.5, "TBps": 2.4},
             {**quantize, "impl": bench.QUANTIZED + " at 64x4 w8", "us": 55.0, "TBps": 1.1}]
    assert bench.summarize(rows) == [
        "down, M=8: int8 5.0 us (2.50 TB/s, 4.00x bf16); int8 gated 8.0 us (1.60 TB/s, 2.50x bf16); fastest tiles "
        "rows 16x256 w2 4.0 us; fastest gated tiles rows 32x256 w2 7.0 us",
        "quantize, M=16384: quantize_rows 30.0 us (2.10 TB/s); fastest pieces 256x16 w4 26.5 us"]
