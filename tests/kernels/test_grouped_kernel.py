"""The mixture-of-experts kernels (``kernels/grouped.py``; Triton's interpreter on CPU, the GPU
where there is one): the row kernel (M <= GROUPED_ROWS_MAX_M) and the sorted-block kernel (above)
against the op's reference: int8 in fp32 bit for bit under the interpreter (exact sums, the same
epilogue order; on a GPU the compiler contracts the epilogue's multiply-adds, so there within the
oracle's fp32 bound), fp8 within the oracle's bound; rows with no valid expert NaN; the routing's
block layout."""

import pytest
import torch

from fusepass.kernels import grouped_launch
from fusepass.kernels.grouped_launch import launch_scaled_grouped_mm, route
from fusepass.kernels.policy import GROUPED_ROWS_MAX_M, GroupedTiles
from fusepass.ops import reference
from tests.ops.test_grouped import assert_matches_oracle
from tests.support.grouped_data import make_grouped

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter converts fp32 to bf16 without rounding to nearest (up to an ulp off, as
# for every kernel it runs); the GPU rounds.
HALF_ULPS = 1 if DEVICE == "cuda" else 2


def assert_as_the_reference(p, out):
    """``out`` (fp32) as the reference computes it: bit for bit under the interpreter, within
    the oracle's fp32 bound on a GPU (fused multiply-adds in the epilogue)."""
    if DEVICE == "cuda":
        assert_matches_oracle(out, p, torch.float32)
        return
    ref = reference.scaled_grouped_mm(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in p.args(torch.float32)])
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0, equal_nan=True)

# (tokens, top_k, E, N, K): decode-like rows (the row kernel: M <= GROUPED_ROWS_MAX_M), then
# prefill-like (the blocks), ragged N and K, experts with no rows.
SHAPES = [(1, 8, 16, 72, 96), (4, 2, 8, 64, 128), (3, 1, 64, 40, 200), (12, 4, 8, 80, 64), (20, 2, 32, 48, 130)]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("tokens,top_k,E,N,K", SHAPES)
def test_the_kernels_against_the_reference(dtype, tokens, top_k, E, N, K):
    p = make_grouped(tokens, top_k, E, N, K, dtype, device=DEVICE, seed=tokens * E)
    p.expert_ids[-1] = E  # (a row with no valid expert: NaN)
    out = launch_scaled_grouped_mm(*p.args())
    assert out[-1].isnan().all()
    assert_matches_oracle(out, p, torch.bfloat16, HALF_ULPS)
    if dtype == torch.int8:  # (in fp32: the interpreter's bf16 rounding is not torch's)
        assert_as_the_reference(p, launch_scaled_grouped_mm(*p.args(torch.float32)))


@pytest.mark.parametrize("M", [GROUPED_ROWS_MAX_M, GROUPED_ROWS_MAX_M + 1])
@pytest.mark.parametrize("variant", [dict(bias=False, row_weights=False), dict(scale_a_shape=(), scale_b_shape=(8,))],
                         ids=str)
def test_both_kernels_take_every_variant(M, variant):
    p = make_grouped(M, 1, 8, 40, 72, device=DEVICE, seed=M, **variant)
    assert_as_the_reference(p, launch_scaled_grouped_mm(*p.args(torch.float32)))


def test_route_sorts_rows_into_blocks_of_one_expert():
    ids = torch.tensor([2, 0, 2, 1, 5, 2, 2], device=DEVICE)
    rows, experts = route(ids, 3, 2)
    M = ids.numel()
    assert rows.numel() == experts.numel() * 2 and rows.numel() >= M + 4 * (2 - 1)
    assert rows.tolist()[:10] == [1, M, 3, M, 0, 2, 5, 6, 4, M]
    assert experts.tolist()[:5] == [0, 1, 2, 2, 3] and all(e == 4 for e in experts.tolist()[5:])
    # every row once, each in a block of its own expert (3: no valid expert)
    placed = rows[rows < M]
    assert sorted(placed.tolist()) == list(range(M))
    block_of = {r: experts[i // 2].item() for i, r in enumerate(rows.tolist()) if r < M}
    assert all(block_of[r] == (ids[r].item() if ids[r] < 3 else 3) for r in range(M))


# (one program up to ROUTE_ONE_PROGRAM_MAX_M = 128 rows, then a program a chunk of 64, up to
# ROUTE_MAX_PROGRAMS of them)
@pytest.mark.parametrize("M,E,rows_a_block", [(1, 8, 16), (40, 8, 16), (128, 128, 16), (129, 128, 16), (256, 128, 16),
                                               (257, 128, 16), (300, 128, 16), (128, 255, 1),
                                               (1000, 64, 64), (130, 3, 4), (300, 256, 16), (700, 3, 64),
                                               (700, 3, 128),
                                               (5000, 8, 64)])  # (79 programs: the counts read in two tiles)
def test_route_kernel_is_the_stable_sort(M, E, rows_a_block):
    g = torch.Generator().manual_seed(M + E)
    ids = torch.randint(-1, E + 1, (M,), generator=g)  # (with ids outside [0, E): their own group)
    rows, experts = route(ids.to(DEVICE), E, rows_a_block)
    want_rows, want_experts = reference.route_experts(ids, E, rows_a_block)
    assert rows.dtype == experts.dtype == torch.int32
    assert rows.cpu().tolist() == want_rows.tolist() and experts.cpu().tolist() == want_experts.tolist()


@pytest.mark.parametrize("max_programs,M", [(2, 300), (3, 300), (3, 129), (None, 9000)])
def test_route_spans_several_chunks_a_program_above_its_programs(monkeypatch, max_programs, M):
    """Above ROUTE_MAX_PROGRAMS chunks each program places a span of whole chunks (the last one
    ragged); 9000 rows at the default: 141 chunks, 71 programs of two."""
    if max_programs is not None:
        monkeypatch.setattr(grouped_launch, "ROUTE_MAX_PROGRAMS", max_programs)
    ids = torch.randint(-1, 9, (M,), generator=torch.Generator().manual_seed(M))
    rows, experts = route(ids.to(DEVICE), 8, 16)
    want_rows, want_experts = reference.route_experts(ids, 8, 16)
    assert rows.cpu().tolist() == want_rows.tolist() and experts.cpu().tolist() == want_experts.tolist()


def test_the_tiles_by_rows_and_rows_an_expert():
    from fusepass.kernels.policy import GROUPED_SMALL_BLOCKS_MAX_ROWS, grouped_tiles

    E, K, N = 128, 2048, 1536
    assert str(grouped_tiles(8, N, K, E)) == "rows 32x512 w4"
    assert str(grouped_tiles(8, 2048, 768, E)) == "rows 32x256 w4"  # (down's K)
    # b contiguous along K (the experts' [E, N, K], transposed): rows of b.T, a block that divides K
    assert str(grouped_tiles(8, N, K, E, contiguous_k=True)) == "rows 8x512 w2"
    assert str(grouped_tiles(8, 2048, 768, E, contiguous_k=True)) == "rows 8x256 w2"
    assert str(grouped_tiles(8, 2048, 768, E, contiguous_k=True, quantizing=True)) == "rows 32x256 w2"
    assert str(grouped_tiles(8, 4, 96, E, contiguous_k=True)) == "rows 8x128 w2"  # (ragged: K masked)
    assert str(grouped_tiles(GROUPED_ROWS_MAX_M + 1, N, K, E, contiguous_k=True)) == "blocks 16x128x256 w8 s3"
    assert str(grouped_tiles(GROUPED_ROWS_MAX_M + 1, N, K, E)) == "blocks 16x128x256 w8 s3"
    assert str(grouped_tiles(GROUPED_SMALL_BLOCKS_MAX_ROWS * E, N, K, E)) == "blocks 16x128x256 w8 s3"
    assert str(grouped_tiles(GROUPED_SMALL_BLOCKS_MAX_ROWS * E + 1, N, K, E)) == "blocks 64x256x128 w8 s4"
    assert str(grouped_tiles(40, 40, 72, 8)) == "blocks 16x64x128 w8 s3"  # (no wider than N and K need)


def _device_memory(monkeypatch, limit, arch="sm90"):
    """The launches see a device of ``arch`` whose programs may take ``limit`` bytes of shared memory."""
    from fusepass.kernels import launch

    monkeypatch.setattr(launch, "shared_memory", lambda device: limit)
    monkeypatch.setattr(launch, "device_arch", lambda device: arch)


def test_the_blocks_stages_fit_the_shared_memory(monkeypatch):
    from fusepass.kernels.grouped_launch import fitted_stages
    from fusepass.kernels.launch import HOPPER_SHARED_MEMORY, SHARED_MEMORY_RESERVE

    cuda = torch.device("cuda")
    prefill = GroupedTiles(False, 64, 256, 128, 8, 4)  # 40 KB a stage
    tall = GroupedTiles(False, 128, 256, 128, 8, 4)  # 48 KB a stage (bench_grouped's sweep has it)
    small = GroupedTiles(False, 16, 128, 256, 8, 3)  # 36 KB a stage
    _device_memory(monkeypatch, HOPPER_SHARED_MEMORY)
    assert fitted_stages(prefill, cuda) == prefill and fitted_stages(tall, cuda) == tall
    _device_memory(monkeypatch, 4 * 40960 + SHARED_MEMORY_RESERVE)
    assert fitted_stages(prefill, cuda) == prefill
    _device_memory(monkeypatch, 4 * 40960 + SHARED_MEMORY_RESERVE - 1)
    assert fitted_stages(prefill, cuda).num_stages == 3
    _device_memory(monkeypatch, 1000)
    assert fitted_stages(prefill, cuda).num_stages == 1
    rows = GroupedTiles(True, 1, 8, 512, 2, 3)
    assert fitted_stages(rows, cuda) == rows
    # (elsewhere than Hopper Triton keeps a buffer fewer than its stages: an sm_89's 99 KB holds 3 of 4)
    _device_memory(monkeypatch, 101376, "sm89")
    assert fitted_stages(prefill, cuda).num_stages == 3 and fitted_stages(small, cuda) == small


class _StagesSpy:
    """``grouped_launch.launcher`` recording the stages each ``grouped_mm_kernel`` launch takes."""

    def __init__(self, monkeypatch):
        self.seen, real = [], grouped_launch.launcher

        seen = self.seen

        class Launch:
            def __init__(self, launch):
                self.launch = launch

            def __getitem__(self, grid):
                launch = self.launch[grid]
                return lambda *args, **kw: (seen.append((kw["BLOCK_K"], kw["num_stages"])), launch(*args, **kw))

        def launcher(kernel, fake):
            launch = real(kernel, fake)
            return Launch(launch) if kernel is grouped_launch.grouped_mm_kernel else launch
        monkeypatch.setattr(grouped_launch, "launcher", launcher)


def test_a_launch_takes_the_stages_that_fit(monkeypatch):
    spy = _StagesSpy(monkeypatch)
    _device_memory(monkeypatch, 3 * (16 + 64) * 128 + 1024)
    p = make_grouped(20, 2, 8, 64, 128, torch.int8, device=DEVICE, seed=3)
    out = launch_scaled_grouped_mm(*p.args(), tiles=GroupedTiles(False, 16, 64, 128, 4, 4))
    assert spy.seen == [(128, 3)]
    assert_matches_oracle(out, p, torch.bfloat16, HALF_ULPS)


def test_block_scales_fit_their_stages_after_the_k_slice(monkeypatch):
    spy = _StagesSpy(monkeypatch)
    _device_memory(monkeypatch, 3 * (16 + 128) * 128 + 1024)  # (3 stages of 128-wide K slices, 1 of 256)
    p = make_grouped(20, 2, 8, 136, 260, torch.float8_e4m3fn, device=DEVICE, seed=5, blocks=True)
    out = launch_scaled_grouped_mm(*p.args(), tiles=GroupedTiles(False, 16, 128, 256, 8, 3))
    assert spy.seen == [(128, 3)]
    assert_matches_oracle(out, p, torch.bfloat16, HALF_ULPS)


@pytest.mark.parametrize("tokens,top_k,E,N,K", [(1, 8, 16, 200, 300), (20, 2, 8, 136, 260)])
def test_the_kernels_with_block_scales(tokens, top_k, E, N, K):
    p = make_grouped(tokens, top_k, E, N, K, torch.float8_e4m3fn, device=DEVICE, seed=tokens + K, blocks=True)
    p.expert_ids[-1] = -1
    out = launch_scaled_grouped_mm(*p.args())
    assert out[-1].isnan().all()
    assert_matches_oracle(out, p, torch.bfloat16, HALF_ULPS)


def test_route_kernel_keeps_an_int64_id_past_int32_invalid():
    ids = torch.tensor([1, 2**32 + 1, 0, -(2**32)], device=DEVICE)
    rows, experts = route(ids, 4, 2)
    want_rows, want_experts = reference.route_experts(ids.cpu(), 4, 2)
    assert rows.cpu().tolist() == want_rows.tolist() and experts.cpu().tolist() == want_experts.tolist()
    assert experts.cpu().tolist()[:3] == [0, 1, 4]  # (rows 1 and 3: the group of invalid ids)


@pytest.mark.parametrize("M", [8, 40])  # (the row kernel and the blocks)
def test_strided_ids_and_vectors(M):
    p = make_grouped(M, 1, 8, 48, 64, device=DEVICE, seed=M)
    want = launch_scaled_grouped_mm(*p.args(torch.float32))
    p.expert_ids = torch.stack([p.expert_ids, p.expert_ids.flip(0)], 1)[:, 0]  # (stride 2, same values)
    p.scale_a = torch.stack([p.scale_a, p.scale_a], 1)[:, 0]
    p.row_weights = torch.stack([p.row_weights, p.row_weights], 1)[:, 0]
    assert p.expert_ids.stride(0) == 2
    torch.testing.assert_close(launch_scaled_grouped_mm(*p.args(torch.float32)), want, rtol=0, atol=0)


@pytest.mark.parametrize("tiles", [GroupedTiles(True, 1, 64, 32, 4, 1), GroupedTiles(False, 16, 256, 32, 4, 2)],
                         ids=str)
def test_block_scales_with_slices_of_a_group_and_tiles_across_blocks(tiles):
    # (BLOCK_K 32: four slices a 128-wide group; BLOCK_N 256: a tile over two 128-wide blocks of N)
    p = make_grouped(5 if tiles.rows else 20, 2, 4, 300, 200, torch.float8_e4m3fn, device=DEVICE, seed=9, blocks=True)
    out = launch_scaled_grouped_mm(*p.args(), tiles=tiles)
    assert_matches_oracle(out, p, torch.bfloat16, HALF_ULPS)


@pytest.mark.parametrize("M", [8, 40])  # (the row kernel and the blocks)
def test_a_row_with_a_nan_scale_is_nan(M):
    p = make_grouped(M, 1, 8, 48, 64, device=DEVICE, seed=M)
    p.scale_a[3] = float("nan")  # (a row quantized from an inf or NaN: its scale is NaN)
    out = launch_scaled_grouped_mm(*p.args())
    assert out[3].isnan().all() and torch.isfinite(out[torch.arange(M, device=out.device) != 3]).all()


@pytest.mark.parametrize("tokens,top_k", [(2, 8), (10, 4)])  # (the row kernel and the blocks)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8-block"])
def test_the_kernels_with_a_row_of_a_a_token(tokens, top_k, dtype):
    blocks = dtype != torch.int8
    p = make_grouped(tokens, top_k, 16, 72, 200, dtype, device=DEVICE, seed=tokens, blocks=blocks)
    a, sa = p.a[::top_k].contiguous(), p.scale_a[::top_k].contiguous()
    p.a, p.scale_a = a.repeat_interleave(top_k, 0), sa.repeat_interleave(top_k, 0)
    want = launch_scaled_grouped_mm(*p.args(torch.float32))
    got = launch_scaled_grouped_mm(a, *p.args(torch.float32)[1:2], sa, *p.args(torch.float32)[3:])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


WRITTEN = {"grouped_gemv_kernel": {"out_ptr"}, "grouped_mm_kernel": {"out_ptr"}, "route_count_kernel": {"counts_ptr"},
           "route_kernel": {"rows_ptr", "block_experts_ptr"}, "quantize_rows_kernel": {"q_ptr", "scale_ptr"}}


def test_every_launch_names_every_argument_and_writes_only_its_outputs(monkeypatch):
    """Each launch of the grouped kernels (the row kernel plain and quantizing its gated rows,
    the blocks plain and after the rows' quantization kernel, both routes) passes every
    argument: the direct launcher and ``wrap_triton`` bind no defaults (the interpreter, which
    would take one, runs them here). And Inductor's analysis of the kernels
    (``tests/support/helpers.written_arguments``) finds it writes its outputs alone: an input it counted as written would be copied by functionalization at every call (a
    [E, K, N] weight's copy, 240 us, on an H200 before this held)."""
    from fusepass.kernels import grouped_launch
    from fusepass.kernels.grouped_launch import Recipe
    from tests.support.helpers import recording_launches, written_arguments

    launches = recording_launches(monkeypatch, grouped_launch)
    for M in (4, 40, 300):  # (the rows; the blocks routed by one program; by a program a chunk)
        p = make_grouped(M, 1, 8, 24, 64, device=DEVICE, seed=M)
        launch_scaled_grouped_mm(*p.args())
    x = torch.randn(4, 64).to(torch.bfloat16).to(DEVICE)
    p = make_grouped(4, 1, 8, 24, 64, device=DEVICE, seed=1)
    launch_scaled_grouped_mm(x, p.b, None, p.scale_b, p.expert_ids, torch.float32, recipe=Recipe(127.5, 1e-8, None, x))
    x = torch.randn(40, 64).to(torch.bfloat16).to(DEVICE)
    p = make_grouped(40, 1, 8, 24, 64, device=DEVICE, seed=2)
    launch_scaled_grouped_mm(x, p.b, None, p.scale_b, p.expert_ids, torch.float32, recipe=Recipe(127.5, 1e-8, None, x))
    assert {k.__name__ for k, _ in launches} == set(WRITTEN)
    for (kernel, _), written in zip(launches, written_arguments(launches)):
        assert written == WRITTEN[kernel.__name__], kernel.__name__


def test_a_given_route_is_taken_where_its_blocks_are_the_launchs(monkeypatch):
    """The sorted blocks take a route made before (a layer's gate/up and down share one) where its
    block size is theirs, and launch no route of their own; a route of another block size they leave."""
    launched, real = [], grouped_launch.launcher

    def launcher(kernel, fake):
        launched.append(getattr(kernel, "__name__", getattr(getattr(kernel, "fn", None), "__name__", "")))
        return real(kernel, fake)
    p = make_grouped(20, 2, 8, 64, 128, torch.int8, device=DEVICE, seed=7)
    tiles = GroupedTiles(False, 16, 64, 128, 4, 2)
    want = launch_scaled_grouped_mm(*p.args(), tiles=tiles)
    monkeypatch.setattr(grouped_launch, "launcher", launcher)
    out = launch_scaled_grouped_mm(*p.args(), tiles=tiles, routed=route(p.expert_ids, 8, 16))
    assert launched.count("route_kernel") == 1 and launched.count("grouped_mm_kernel") == 1  # (the one routing)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    launched.clear()
    out = launch_scaled_grouped_mm(*p.args(), tiles=tiles, routed=route(p.expert_ids, 8, 32))
    assert launched.count("route_kernel") == 2  # (the given one at 32 rows, then the launch's own at 16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
