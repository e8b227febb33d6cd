"""The Triton kernel itself (Triton's interpreter on CPU, the GPU when there is one),
against the ops' CPU reference, over every epilogue variant and tile path."""

import dataclasses
import json

import pytest
import torch

from fusepass.kernels import launch_scaled_mm
from fusepass.kernels import configs, launch
from fusepass.kernels.configs import Config, select_config
from fusepass.kernels.launch import tma_allowed
from tests.support.helpers import SPLIT_REQUESTS, assert_matches_oracle, make_problem, record_split_requests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Triton's interpreter rounds fp32 -> bf16 toward zero (runtime/interpreter.py, cast_impl),
# where the GPU rounds to nearest: allow one bf16 ulp there.
BF16_ULPS = 1.0 if DEVICE == "cpu" else 0.0

# Each shape hits a different path: decode tile (M <= 16), ragged M/N that wrap around,
# K below one block, K a multiple of BLOCK_K (unmasked loop) and K ragged over several blocks.
SHAPES = [(1, 17, 33), (7, 100, 17), (16, 64, 128), (33, 48, 256), (70, 130, 300)]
VARIANTS = [
    dict(sa_shape=(), sb_shape=()),
    dict(sa_shape=(1,), sb_shape=(1, 1)),
    dict(bias_dtype=torch.float32),
    dict(sb_shape=(), bias_dtype=torch.bfloat16),
]


def _run(p, out_dtype):
    return launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias, p.azp_adj, p.azp)


def _ulps(out_dtype):
    return BF16_ULPS if out_dtype == torch.bfloat16 else 0.0


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_scaled_mm(dtype, M, N, K, variant, out_dtype):
    p = make_problem(M, N, K, dtype, device=DEVICE, seed=variant, **VARIANTS[variant])
    assert_matches_oracle(_run(p, out_dtype), p, out_dtype, extra_ulps=_ulps(out_dtype))


@pytest.mark.parametrize("azp", ["tensor", "token"])
@pytest.mark.parametrize("azp_dtype", [torch.int32, torch.float32], ids=str)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_kernel_scaled_mm_azp(azp, azp_dtype, M, N, K):
    p = make_problem(M, N, K, device=DEVICE, azp=azp, azp_dtype=azp_dtype, bias_dtype=torch.float32)
    assert_matches_oracle(_run(p, torch.float32), p, torch.float32)


def test_kernel_int32_path_is_exact():
    # Unit scales, fp32 out, int32 zero points: the result is an exact integer below 2**24.
    p = make_problem(20, 40, 64, device=DEVICE, sa_shape=(), sb_shape=(), azp="token")
    p.scale_a.fill_(1.0)
    p.scale_b.fill_(1.0)
    out = _run(p, torch.float32)
    # float64 holds these integers exactly (and CUDA has no int64 matmul).
    exact = p.a.double() @ p.b.double() - p.azp.double()[:, None] * p.azp_adj.double()[None, :]
    assert torch.equal(out.double(), exact)


@pytest.mark.parametrize("M", [1, 2])  # (the M = 1 kernel's epilogue, and the tiled one's)
@pytest.mark.parametrize("case", ["tensor, past", "token, past", "token, colsum past", "int64, any range",
                                  "tensor, within", "token, within", "int64, within"])
def test_kernel_integer_zero_point_terms_exact_within_bounds_refused_past_them(case, M):
    from tests.ops.test_scaled_mm import ZERO_POINTS

    azp_adj, zp, value = ZERO_POINTS[case]
    a = torch.zeros(M, 64, dtype=torch.int8, device=DEVICE)
    b = torch.ones(3, 64, dtype=torch.int8, device=DEVICE).t()  # (as a weight is stored: the M = 1 kernel's)
    zp = None if zp is None else zp[:1].expand(M).contiguous().to(DEVICE)
    out = launch_scaled_mm(a, b, torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE), torch.float32, None,
                           azp_adj.to(DEVICE), zp).cpu()
    torch.testing.assert_close(out, torch.full((M, 3), value), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("M", [1, 2])  # (the M = 1 kernel's epilogue, and the tiled one's)
def test_kernel_multiplies_the_scales_together_first(M):
    a = torch.full((M, 64), 100, dtype=torch.int8, device=DEVICE)
    b = torch.full((3, 64), -100, dtype=torch.int8, device=DEVICE).t()
    out = launch_scaled_mm(a, b, torch.full((M, 1), 1e36, device=DEVICE), torch.full((3,), 1e-20, device=DEVICE),
                           torch.float32)
    torch.testing.assert_close(out.cpu(), torch.full((M, 3), -6.4e21), rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", ["a_strided", "b_row_major", "b_sliced"])
def test_kernel_any_strides(layout):
    p = make_problem(9, 24, 40, device=DEVICE, bias_dtype=torch.float32)
    if layout == "a_strided":
        p.a = torch.cat([p.a, p.a], dim=1)[:, ::2]
    elif layout == "b_row_major":
        p.b = p.b.contiguous()
    else:
        p.b = torch.cat([p.b, p.b], dim=1)[:, 24:]
    assert_matches_oracle(_run(p, torch.float32), p, torch.float32)


def test_kernel_writes_every_element():
    p = make_problem(33, 70, 50, device=DEVICE)
    out = _run(p, torch.float32)
    assert out.shape == (33, 70) and out.is_contiguous()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", [None, Config(16, 32, 32, split_k=3)], ids=["tuned", "split3"])
def test_kernel_widens_bf16_and_fp16_scales_exactly(scale_dtype, config):
    """torchao's bf16 weight scales go in as they are: the same bits out as their fp32 copies."""
    p = make_problem(5, 48, 64, device=DEVICE, bias_dtype=torch.float32)
    sa, sb = p.scale_a.to(scale_dtype), p.scale_b.to(scale_dtype)
    narrow = launch_scaled_mm(p.a, p.b, sa, sb, torch.bfloat16, p.bias, config=config)
    wide = launch_scaled_mm(p.a, p.b, sa.float(), sb.float(), torch.bfloat16, p.bias, config=config)
    assert torch.equal(narrow, wide)


# The main-loop paths beside the default: TMA loads through device-made descriptors (zero
# fill past the edges), split-K (slices, tickets and the last program's sum; split counts
# that leave empty slices), both.
PATHS = {
    "tma": Config(16, 32, 32, tma=True),
    "split3": Config(16, 32, 32, split_k=3),
    "split_tma": Config(32, 64, 64, split_k=2, tma=True),
    "split_many": Config(16, 16, 32, split_k=20),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M,N,K", [(1, 17, 48), (33, 48, 256), (70, 130, 300)])
def test_kernel_paths(path, dtype, M, N, K):
    p = make_problem(M, N, K, dtype, device=DEVICE, bias_dtype=torch.float32)
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, config=PATHS[path])
    assert_matches_oracle(out, p, torch.float32)


@pytest.mark.parametrize("path", ["split3", "split_tma"])
@pytest.mark.parametrize("azp", ["tensor", "token"])
def test_kernel_paths_azp(path, azp):
    # Split-K applies the zero point once, to the summed slices, in int32.
    p = make_problem(7, 100, 160, device=DEVICE, azp=azp, bias_dtype=torch.float32)
    out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, p.azp_adj, p.azp, config=PATHS[path])
    assert_matches_oracle(out, p, torch.float32)


def test_tma_falls_back_on_unaligned_layouts():
    # K=40 rows of a are not 16-byte aligned, and a strided a has no unit stride: pointer loads.
    for layout in ["ragged_rows", "strided"]:
        p = make_problem(9, 24, 40, device=DEVICE, bias_dtype=torch.float32)
        if layout == "strided":
            p.a = torch.cat([p.a, p.a], dim=1)[:, ::2]
        assert not tma_allowed(p.a, p.b)
        out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, config=PATHS["tma"])
        assert_matches_oracle(out, p, torch.float32)
    p = make_problem(9, 24, 48, device=DEVICE)
    assert tma_allowed(p.a, p.b)


def test_config_covers_small_dims():
    cfg = select_config(3, 17, 17)
    assert cfg.block_m == 16 and cfg.block_n == 32 and cfg.block_k == 32
    assert select_config(4096, 4096, 4096).block_m == 128


def untuned(bucket: int, cfg: Config, N: int, K: int) -> Config:
    """What a shape the table lacks gets from ``cfg`` (a bucket default): fitted, split at decode."""
    return configs.derive_split(configs.fit(cfg, N, K), bucket, N, K, configs.DEFAULT_SMS)


def test_config_table_lookup(table_dir):
    tuned = Config(16, 128, 256, num_warps=4, num_stages=3, split_k=4, tma=True)
    default = Config(16, 32, 128, split_k=2)
    (table_dir / "sm90.json").write_text(json.dumps({
        "shapes": {"fp8,M<=16,4096,4096": {"config": tuned.as_dict(), "us": 1.0}},
        "defaults": {"fp8,M<=16": {"config": default.as_dict()}},
    }))
    b16, b1 = configs.m_bucket(16), configs.m_bucket(1)
    # tuned shape; host-bound decode buckets load through pointers, never TMA
    assert configs._config(b16, 4096, 4096, "fp8", "sm90") == dataclasses.replace(tuned, tma=False)
    assert configs._config(b16, 4096, 8192, "fp8", "sm90") == untuned(b16, default, 4096, 8192)  # unseen shape
    assert configs._config(b16, 4096, 4096, "int8", "sm90") == untuned(b16, configs.BUILTIN[b16], 4096, 4096)  # other dtype
    assert configs._config(b1, 4096, 4096, "fp8", "sm90") == untuned(b1, configs.BUILTIN[b1], 4096, 4096)  # other bucket
    assert configs._config(b16, 4096, 4096, "fp8", "sm80") == untuned(b16, configs.BUILTIN[b16], 4096, 4096)  # no table
    assert configs._config(b16, 4096, 4096, "fp8", None) == untuned(b16, configs.BUILTIN[b16], 4096, 4096)  # interpreter


def test_config_tma_only_above_decode_buckets(table_dir):
    tuned = Config(128, 128, 128, num_warps=8, tma=True)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {}, "defaults": {
        f"int8,{configs.bucket_name(b)}": {"config": tuned.as_dict()} for b in range(len(configs.M_BUCKETS))}}))
    for m in (1, 16, 64, 65, 256, 4096, 16384):
        assert configs._config(configs.m_bucket(m), 4096, 4096, "int8", "sm90").tma == (m > configs.POINTER_LOADS_MAX_M)


def test_config_table_azp_falls_back_to_int8(table_dir):
    plain, azp, azp_default = Config(16, 32, 128), Config(16, 64, 256), Config(16, 128, 128)
    (table_dir / "sm90.json").write_text(json.dumps({
        "shapes": {"int8,M<=16,64,64": {"config": plain.as_dict()}, "int8_azp,M<=16,256,512": {"config": azp.as_dict()}},
        "defaults": {"int8_azp,M<=16": {"config": azp_default.as_dict()}},
    }))
    b16 = configs.m_bucket(16)
    assert configs._config(b16, 256, 512, "int8_azp", "sm90") == azp
    assert configs._config(b16, 64, 64, "int8_azp", "sm90") == configs.fit(plain, 64, 64)  # int8's tuned shape
    assert configs._config(b16, 256, 256, "int8_azp", "sm90") == untuned(b16, azp_default, 256, 256)
    assert configs._config(b16, 256, 256, "int8", "sm90") == untuned(b16, configs.BUILTIN[b16], 256, 256)


# The split of a shape the table lacks, at a decode bucket: the largest power of two <= 8 and
# <= the K blocks with at most 2 programs per SM (132 SMs: 264). Measured on an H200 (NOTES run
# 7): k_proj (N = 1024) at M = 1 in 8 tiles of 128 -> 8 splits, 12.8 -> 7.6 us; gate_proj (N =
# 14336, 112 tiles) -> 2; lm_head (N = 32000, 250 tiles) stays whole; M <= 16 in tiles of 32.
@pytest.mark.parametrize("M,N,K,block_n,split", [
    (1, 1024, 4096, 128, 8), (1, 14336, 4096, 128, 2), (1, 32000, 4096, 128, 1),
    (16, 1024, 4096, 32, 8), (16, 2048, 4096, 32, 4), (16, 14336, 4096, 32, 1),
    (1, 1024, 512, 128, 2),  # K = 512 has 2 blocks of 256
    (1, 16896, 4096, 128, 2), (1, 16897, 4096, 128, 1),  # 132 tiles: 2 x 132 = 264 programs; 133: 266
    (64, 1024, 4096, 64, 1),  # above the decode buckets: the table's split, none derived
])
def test_config_derived_split_fills_the_gpu(M, N, K, block_n, split):
    cfg = Config(16 if M <= 16 else 64, block_n, 256)
    assert configs.derive_split(cfg, configs.m_bucket(M), N, K, 132).split_k == split


# Above the pointer-load buckets, at a static M, the bucket default's tiles (256 x 128 here, as
# the shipped table's) where fewer than 132: LARGE_M_FILL's 128 x 128 where they take fewer rounds
# of 132 tiles (in 128 x 128 units). k_proj's N = 1024: 64 tiles at M = 2048 (one round of 2
# units against one of 1); at M = 4096, 128 tiles against 256 of 128 x 128 (2 rounds each): kept.
@pytest.mark.parametrize("M,N,filled", [
    (2048, 1024, True), (1024, 1024, True), (300, 1024, True), (3000, 512, True),
    (4096, 1024, False), (20000, 1024, False), (20000, 512, False),
    (2048, 14336, False), (2048, 6144, False),  # 8 x 112 and 8 x 48 tiles
    (16, 1024, False), (64, 1024, False),  # pointer-load buckets (M <= 16 split along K instead)
])
def test_config_narrow_weight_above_decode_takes_smaller_tiles(table_dir, M, N, filled):
    wide = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {}, "defaults": {
        f"int8,{configs.bucket_name(b)}": {"config": wide.as_dict()} for b in range(len(configs.M_BUCKETS))}}))
    bucket = configs.m_bucket(M)
    cfg = configs._config(bucket, N, 4096, "int8", "sm90", 132, M=M)  # (select_config's, on an sm90)
    assert (cfg == configs.LARGE_M_FILL) == filled, cfg
    assert filled or (cfg.block_m, cfg.block_n) == (256, 128)
    # a symbolic M (the bucket's configs) keeps the bucket's tiles
    assert configs._config(bucket, N, 4096, "int8", "sm90", 132).block_m == 256


def test_config_narrow_tuned_shape_keeps_its_tiles(table_dir):
    tuned = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {"int8,M<=4096,1024,4096": {"config": tuned.as_dict()}},
                                                     "defaults": {}}))
    assert configs._config(configs.m_bucket(2048), 1024, 4096, "int8", "sm90", 132, M=2048) == tuned
    # a default tile no larger is never replaced (the built-in 128 x 128, and 64 x 128 at M <= 256)
    for M in (2048, 200):
        bucket = configs.m_bucket(M)
        assert configs._config(bucket, 256, 4096, "int8", "sm90", 132, M=M) == configs.fit(
            configs.BUILTIN[bucket], 256, 4096)


def test_select_config_fills_at_the_calls_m(table_dir, monkeypatch):
    wide = Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {}, "defaults": {
        f"int8,{configs.bucket_name(b)}": {"config": wide.as_dict()} for b in range(len(configs.M_BUCKETS))}}))
    monkeypatch.setattr(configs, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)  # (whatever GPU runs the test)
    device = torch.device("cuda", 0)
    assert configs.select_config(2048, 1024, 4096, torch.int8, device) == configs.LARGE_M_FILL
    assert configs.select_config(4096, 1024, 4096, torch.int8, device) == wide
    assert configs.select_config(2047, 1024, 4096, torch.int8, device) == configs.LARGE_M_FILL
    # the fill keeps the bucket's load kind
    no_tma = dataclasses.replace(wide, tma=False, persistent=False)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {}, "defaults": {
        f"int8,{configs.bucket_name(b)}": {"config": no_tma.as_dict()} for b in range(len(configs.M_BUCKETS))}}))
    configs._config.cache_clear()
    configs.load_table.cache_clear()
    assert configs.select_config(2048, 1024, 4096, torch.int8, device) == dataclasses.replace(
        configs.LARGE_M_FILL, tma=False)


def test_config_tuned_shape_keeps_its_split(table_dir):
    tuned = Config(16, 128, 256, split_k=1)  # unsplit although its 8 tiles leave SMs idle
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {"int8,M<=1,1024,4096": {"config": tuned.as_dict()}},
                                                     "defaults": {}}))
    assert configs._config(configs.m_bucket(1), 1024, 4096, "int8", "sm90", 132) == tuned
    assert configs._config(configs.m_bucket(1), 1024, 8192, "int8", "sm90", 132).split_k == 8  # builtin, derived
    # int8 with zero points falls back to int8's tuned shape, split included
    assert configs._config(configs.m_bucket(1), 1024, 4096, "int8_azp", "sm90", 132) == tuned


def test_config_split_follows_the_device_sm_count(table_dir, monkeypatch):
    # The built-in M <= 16 tile is 16 x 64: N = 1024 has 16 tiles, N = 4096 has 64.
    device = torch.device("cuda", 0)  # never asked: sm_count is replaced (16 SMs; 132 elsewhere)
    monkeypatch.setattr(configs, "sm_count", lambda d: 16 if d == device else 132)
    assert configs.select_config(1, 1024, 4096).split_k == 8  # 16 x 8 = 128 <= 2 x 132
    assert configs.select_config(1, 1024, 4096, device=device).split_k == 2  # 16 x 2 = 32 <= 2 x 16
    assert configs.select_config(1, 4096, 4096, device=device).split_k == 1  # 64 > 32
    cpu = torch.device("cpu")
    assert configs.bucket_choices(4096, 4096, torch.int8, cpu)[0][1].split_k == 4  # 64 x 4 = 256
    assert configs.bucket_choices(4096, 4096, torch.int8, device)[0][1].split_k == 1


def test_decode_splits_only_where_launches_are_hidden(table_dir):
    # Compiled code outside a CUDA graph drops the split: the counters' fill is one more
    # launch a host-bound decode step pays for (benchmarks/NOTES.md, run 9); a larger M keeps it.
    split = select_config(1, 1024, 4096)
    assert split.split_k == 8 and select_config(1, 1024, 4096, split_decode=False) == dataclasses.replace(split, split_k=1)
    assert select_config(16, 1024, 4096, split_decode=False).split_k == 1
    outside = configs.bucket_choices(1024, 4096, torch.int8, torch.device("cpu"), split_decode=False)
    assert [(top, c.split_k) for top, c in outside][0] == (16, 1)  # the two decode buckets: one config
    tuned = Config(16, 32, 256, split_k=4)
    (table_dir / "sm90.json").write_text(json.dumps({"shapes": {"int8,M<=1,1024,4096": {"config": tuned.as_dict()},
                                                                "int8,M<=64,1024,4096": {"config": tuned.as_dict()}},
                                                     "defaults": {}}))
    assert configs._config(configs.m_bucket(1), 1024, 4096, "int8", "sm90", 132, False).split_k == 1
    assert configs._config(configs.m_bucket(64), 1024, 4096, "int8", "sm90", 132, False) == tuned


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["default", "cudagraphs"])
@pytest.mark.parametrize("outside", [False, True], ids=["", "split_k_outside_cuda_graphs"])
def test_decode_splits_where_launches_are_hidden(cudagraphs, outside):
    """Traced: with Inductor's cudagraphs option, or where the pass or the backend says the
    caller captures (``splitting_outside_graphs``), never for a symbolic M (its cond runs
    outside CUDA graphs) but then; eagerly always. The op's implementation reads where its
    launches run (``registry.launch_graphs``) and hands it to the policy."""
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusepass.kernels.policy import NO_GRAPHS, Graphs, decode_splits, splitting_outside_graphs
    from fusepass.ops.registry import launch_graphs

    graphs = Graphs(inductor=cudagraphs, caller=outside)
    assert decode_splits(True, False, graphs) is (cudagraphs or outside)
    assert decode_splits(True, True, graphs) is outside
    assert decode_splits(False, False, NO_GRAPHS) is True
    with FakeTensorMode():
        fake = torch.empty(2, 2)
    real = torch.empty(2, 2)
    with inductor_config.patch({"triton.cudagraphs": cudagraphs}), splitting_outside_graphs(outside):
        assert launch_graphs(fake) == graphs and launch_graphs(real) == NO_GRAPHS
    with inductor_config.patch({"triton.cudagraphs": cudagraphs}):  # (the context undone)
        assert launch_graphs(fake) == Graphs(inductor=cudagraphs)


@pytest.mark.parametrize("outside", [False, True])
def test_the_pass_hands_its_split_decision_to_the_launches(outside, monkeypatch):
    """FusePass lowers its calls with its config's split_k_outside_cuda_graphs in force."""
    import torch.fx as fx

    import fusepass
    from fusepass.passes import fuse_pass

    from fusepass.kernels.policy import SPLIT_OUTSIDE_GRAPHS

    seen = []
    monkeypatch.setattr(fuse_pass, "lower", lambda graph: seen.append(SPLIT_OUTSIDE_GRAPHS.get()) or 0)
    fusepass.FusePass(fusepass.PassConfig(split_k_outside_cuda_graphs=outside))(fx.Graph())
    assert seen == [outside] and SPLIT_OUTSIDE_GRAPHS.get() is False


def test_launch_asks_for_the_split_the_policy_gives(monkeypatch):
    """The launch code's wiring: eagerly, traced with a static M, traced with a symbolic one."""
    p = make_problem(3, 64, 256, device=DEVICE)
    run = lambda *t: launch_scaled_mm(*t, torch.float32)  # noqa: E731
    assert record_split_requests(monkeypatch, launch, run, (p.a, p.b, p.scale_a, p.scale_b)) == SPLIT_REQUESTS


def test_config_buckets():
    assert [configs.bucket_name(configs.m_bucket(m)) for m in (1, 2, 16, 17, 4096, 4097, 10**6)] == [
        "M<=1", "M<=16", "M<=16", "M<=64", "M<=4096", "M>4096", "M>4096"]
    assert configs.table_key("int8", configs.m_bucket(64), 10, 20) == "int8,M<=64,10,20"


def test_config_fit_shrinks_split_k():
    # K=100 has 4 blocks of 32: more splits than blocks would leave empty programs.
    assert configs.fit(Config(16, 64, 128, split_k=8), 50, 100) == Config(16, 64, 128, split_k=1)
    assert configs.fit(Config(16, 64, 32, split_k=8), 50, 100).split_k == 4


def test_shipped_tables_parse():
    for path in configs.TABLE_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        for entry in [*table["shapes"].values(), *table["defaults"].values()]:
            Config(**entry["config"])
