"""benchmarks/tune.py's table bookkeeping (the tuning itself needs a GPU): an updated table
keeps the commands that wrote it and its notes."""

import json

import pytest
import torch

from fusepass.kernels.launch import persistent_stages
from tests.support.bench_scripts import load


@pytest.fixture(scope="module")
def tune():
    return load("tune")


def test_save_appends_the_command_and_keeps_notes(tune, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(tune, "device_arch", lambda d: "sm90")
    out = tmp_path / "sm90.json"
    table = {"defaults": {}, "shapes": {}, "meta": {"command": "python benchmarks/tune.py", "notes": "kept"}}
    tune.save(table, str(out), ["--shapes", "8b-hf"])
    tune.save(table, str(out), ["--shapes", "8b-hf"])  # the same command again: listed once
    meta = json.loads(out.read_text())["meta"]
    assert meta["commands"] == ["python benchmarks/tune.py", "python benchmarks/tune.py --shapes 8b-hf"]
    assert meta["notes"] == "kept" and "command" not in meta and meta["gpu"] == "NVIDIA H200"


# The tuning procedure and the choice rule, with made-up times (no GPU).
def _cfg(tune, bn=64, split=1, stages=4, bm=16):
    return tune.Config(bm, bn, 256, group_m=8, num_warps=4, num_stages=stages, split_k=split)


@pytest.mark.parametrize("M", [1, 16])
def test_choose_at_decode_weighs_the_unsplit_form(tune, M):
    bucket = tune.m_bucket(M)
    assert tune.runs_unsplit(bucket)
    a4, a1, b1 = _cfg(tune, 64, 4), _cfg(tune, 64, 1), _cfg(tune, 128, 1)
    # a4 is fastest, but unsplit (outside CUDA graphs) it is 20 / 12 = 1.67x the best unsplit.
    results = {a4: 10.0, a1: 20.0, b1: 12.0}
    assert min(results, key=results.get) == a4 and tune.choose(results, bucket) == b1
    # With a near-best unsplit form the split config wins: max(1, 12.5 / 12) < max(1.2, 1).
    assert tune.choose({**results, a1: 12.5}, bucket) == a4
    # An unsplit config fastest overall is chosen.
    assert tune.choose({a4: 10.0, a1: 20.0, b1: 9.0}, bucket) == b1


def test_choose_never_takes_a_split_config_whose_unsplit_form_has_no_time(tune):
    c8, b1 = _cfg(tune, 32, 8), _cfg(tune, 128, 1)
    assert tune.choose({c8: 5.0, b1: 12.0}, tune.m_bucket(1)) == b1


def test_choose_breaks_ties_to_the_faster(tune):
    a4, a1, b1 = _cfg(tune, 64, 4), _cfg(tune, 64, 1), _cfg(tune, 128, 1)
    # b1: max(16 / 8, 1) = 2; a4: max(1, 32 / 16) = 2; a4 is faster (b1 first, as min keeps the first).
    assert tune.choose({b1: 16.0, a4: 8.0, a1: 32.0}, tune.m_bucket(16)) == a4


@pytest.mark.parametrize("M", [64, 256, 16384])
def test_choose_elsewhere_takes_the_fastest(tune, M):
    bucket = tune.m_bucket(M)
    assert not tune.runs_unsplit(bucket)
    a4, a1, b1 = _cfg(tune, 64, 4, bm=64), _cfg(tune, 64, 1, bm=64), _cfg(tune, 128, 1, bm=64)
    assert tune.choose({a1: 20.0, a4: 10.0, b1: 12.0}, bucket) == a4


def test_wide_grid(tune):
    for M, size in ((1, 144), (16, 144), (64, 108)):
        grid = tune.grid_candidates(tune.m_bucket(M), "wide")
        assert len(grid) == len(set(grid)) == size
        assert not any(c.tma for c in grid) and {c.split_k for c in grid} > {1}
        assert {c.block_m for c in grid} == ({16} if M <= 16 else {32, 64})
    # Above M = 64 the wide grid is the base procedure.
    for M in (256, 1024, 4096, 16384):
        assert tune.grid_candidates(tune.m_bucket(M), "wide") == tune.base_candidates(tune.m_bucket(M))


def test_base_grid_is_the_base_tiles(tune):
    # Today's candidates: the decode tiles with pointer loads, the large-M ones with and without TMA.
    assert tune.grid_candidates(0, "base") == [tune.replace(c, tma=False) for c in tune.DECODE]
    assert len(tune.grid_candidates(4, "base")) == 16 and sum(c.tma for c in tune.grid_candidates(4, "base")) == 10
    for bucket in range(len(tune.M_BUCKETS)):
        assert tune.grid_candidates(bucket, "base") == tune.base_candidates(bucket)
        # the persistent kernel's tiles from M <= 1024 up (TMA loads), nowhere below
        persistent = [c for c in tune.base_candidates(bucket) if c.persistent]
        assert persistent == (tune.PERSISTENT if (tune.M_BUCKETS[bucket] or 1 << 30) >= 1024 else [])
        assert all(c.tma and c.split_k == 1 for c in persistent)


def _fake_time(cfg):
    """Made-up us: splits and deeper pipelines faster; 6 stages out of resources. The small
    terms keep any two configs apart, so the fastest is one config whatever the order."""
    if cfg.num_stages == 6:
        raise RuntimeError("OutOfResources: shared memory")
    return (100.0 / cfg.split_k + 10.0 / cfg.num_stages + cfg.block_n / 64 + cfg.block_k / 512
            + cfg.block_m / 1e3 + cfg.num_warps / 1e4 + cfg.tma / 1e5)


def _search(tune, M, grid, N=4096, K=4096):
    logged = []
    results = tune.search(tune.m_bucket(M), N, K, grid, _fake_time, logged.append)
    return results, logged


@pytest.mark.parametrize("M", [64, 256, 1024, 4096])
def test_base_search_is_todays_procedure(tune, M):
    bucket = tune.m_bucket(M)
    results, _ = _search(tune, M, "base")
    tried = {tune.BUILTIN[bucket], *tune.base_candidates(bucket)}
    best = min(tried, key=_fake_time)
    if M <= 256:
        tried |= {tune.replace(best, split_k=s) for s in tune.SPLITS}
    assert min(tried, key=_fake_time).split_k == (8 if M <= 256 else 1)
    for persistent in (False, True):  # each kernel's best tiles get their depth refined
        family = [c for c in tried if c.persistent == persistent]
        if family:
            tried |= {tune.replace(min(family, key=_fake_time), num_stages=s) for s in tune.STAGES}
    assert any(c.persistent for c in tried) == (M >= 1024)
    # never timed: persistent depths launch would cut to fit shared memory beside a bf16 store
    cut = {c for c in tried if c.persistent and persistent_stages(c, 2, torch.device("cuda")) != c}
    assert {c.num_stages for c in cut} <= {5}
    assert set(results) == tried - cut  # nothing more: no unsplit form where the split is kept


@pytest.mark.parametrize("M", [1, 16])
def test_base_search_at_decode_times_the_unsplit_form(tune, M):
    results, _ = _search(tune, M, "base")
    fastest = min(results, key=results.get)
    assert fastest.split_k == 8 and tune.replace(fastest, split_k=1) in results
    # The refinement's other split configs have no unsplit time: the fastest's form is the one chosen or not.
    chosen = tune.choose(results, tune.m_bucket(M))
    assert tune.replace(chosen, split_k=1) in results


def test_wide_search_times_the_grid_and_skips_failures(tune):
    results, logged = _search(tune, 16, "wide")
    grid = tune.WIDE_DECODE
    assert set(results) == {c for c in grid if c.num_stages != 6}  # the built-in default is in the grid
    assert len(logged) == sum(c.num_stages == 6 for c in grid) == 36
    assert all("skip" in line and "OutOfResources" in line for line in logged)
    results, _ = _search(tune, 64, "wide")
    assert set(results) == set(tune.WIDE_SMALL)
    # fit() dedupes: at K = 128, block_k 256 shrinks to 128 and split_k to 1.
    results, _ = _search(tune, 64, "wide", K=128)
    assert len(results) == 2 * 3 * 3 and all(c.block_k == 128 and c.split_k == 1 for c in results)
    # Above M = 64, --grid wide is --grid base.
    assert set(_search(tune, 256, "wide")[0]) == set(_search(tune, 256, "base")[0])


def test_search_times_the_config_launch_takes_today(tune):
    """A row records what it gains over today's config, even one outside the grid."""
    today = _cfg(tune, bn=256, split=2, stages=3, bm=32)
    assert today not in tune.WIDE_DECODE
    results = tune.search(tune.m_bucket(1), 4096, 4096, "wide", _fake_time, lambda _: None, today)
    assert results[today] == _fake_time(today) and set(results) - {today} <= set(tune.WIDE_DECODE)


def test_pick_default_picks_among_the_grid(tune):
    bucket = tune.m_bucket(64)
    per_shape = {(N, K): _search(tune, 64, "wide", N, K)[0] for N, K in [(4096, 4096), (8192, 8192)]}
    default, score = tune.pick_default(bucket, per_shape, "wide")
    assert default in tune.WIDE_SMALL and default.split_k == 4 and score == pytest.approx(1.0)
    # The base tiles hold no split config: their best is slower.
    assert tune.pick_default(bucket, per_shape)[1] > 1.5


def test_precompile_compiles_the_grid(tune):
    shapes = [(4096, 4096), (8192, 28672)]
    jobs = tune.compile_jobs(["fp8"], [0, 1, 2], shapes, "wide")
    assert len(jobs) == 144 + 144 + 108  # M = 1 compiles apart; every other M at M = 16
    assert {(M, tune.Config(**cfg)) for _, cfg, M, _, _ in jobs} == {
        *((1, c) for c in tune.WIDE_DECODE), *((16, c) for c in tune.WIDE_DECODE), *((16, c) for c in tune.WIDE_SMALL)}
    base = tune.compile_jobs(["fp8"], [0, 1, 2], shapes, "base")
    assert len(base) == 6 + 6 + 6  # the built-in defaults are among the base tiles


def test_grid_option(tune, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--grid", "wide"]) == 2  # parsed; then no GPU
    with pytest.raises(SystemExit):
        tune.main(["--grid", "widest"])


def test_persistent_depths_that_would_not_fit_are_never_timed(tune):
    # 256x128x128 at 5 stages: 240 KB of loads + a 32 KB bf16 store buffer > the H200's 227 KB;
    # launch would cut it to 4 stages, so timing it would time the 4-stage kernel twice.
    def measure(cfg):
        wide = cfg.persistent and cfg.block_m == 256
        return (1.0 + cfg.num_stages / 100) if wide else 100 + _fake_time(cfg)
    logged = []
    results = tune.search(tune.m_bucket(4096), 4096, 4096, "base", measure, logged.append)
    wide = {c.num_stages for c in results if c.persistent and c.block_m == 256}
    assert wide == {2, 3, 4}
    assert [line for line in logged if "fewer stages" in line] == [
        "    skip " + str(tune.replace(tune.PERSISTENT[0], num_stages=5)) + ": launch would run it with fewer stages (shared memory)"]
