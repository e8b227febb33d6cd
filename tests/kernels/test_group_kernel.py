"""The grouped kernel (Triton's interpreter on CPU, the GPU when there is one): each member
bit for bit the plain kernel's result on the same operands (int8: exact sums; fp8: the same
BLOCK_K, so the same order), over member counts, ragged sizes and epilogue variants."""

import dataclasses

import pytest
import torch

from fusepass.kernels import configs, launch_scaled_mm
from fusepass.kernels.configs import gemv_config
from fusepass.kernels.group_launch import group_config, launch_scaled_mm_group
from tests.support.helpers import make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (M, [N_i], K): Llama-like q/k/v and gate/up at toy size, ragged N and K, one K block, M
# over several tiles.
SHAPES = [(1, [64, 16, 16], 64), (5, [40, 100], 33), (16, [32, 32, 48, 16], 256), (33, [17, 64], 130)]
VARIANTS = [
    dict(),  # per-token x per-channel
    dict(sa_shape=(), sb_shape=(), bias_dtype=torch.bfloat16),
    dict(sa_shape=(1,), bias_dtype=torch.float32),
]


def _members(M, Ns, K, dtype, variant):
    problems = [make_problem(M, N, K, dtype, device=DEVICE, seed=i, **VARIANTS[variant]) for i, N in enumerate(Ns)]
    a, scale_a = problems[0].a, problems[0].scale_a
    return a, scale_a, problems


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M,Ns,K", SHAPES)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_each_member_is_the_plain_kernels_result(dtype, M, Ns, K, variant):
    a, scale_a, problems = _members(M, Ns, K, dtype, variant)
    cfg = group_config(M, Ns, K, dtype, torch.device(DEVICE), k_contiguous=False)
    outs = launch_scaled_mm_group(a, [p.b for p in problems], scale_a, [p.scale_b for p in problems],
                                  torch.bfloat16, [p.bias for p in problems], config=cfg)
    assert len(outs) == len(Ns)
    for out, p in zip(outs, problems):
        want = launch_scaled_mm(a, p.b, scale_a, p.scale_b, torch.bfloat16, p.bias, config=cfg)
        assert out.shape == want.shape and out.is_contiguous()
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_many_tiles_per_member():
    """Many tiles per member (BLOCK_N = 16): each lands where the plain kernel puts it."""
    a, scale_a, problems = _members(3, [50, 70, 20], 64, torch.int8, 0)
    cfg = dataclasses.replace(group_config(3, [50, 70, 20], 64, torch.int8, torch.device(DEVICE), k_contiguous=True),
                              block_n=16)
    outs = launch_scaled_mm_group(a, [p.b for p in problems], scale_a, [p.scale_b for p in problems],
                                  torch.float32, [None] * 3, config=cfg)
    for out, p in zip(outs, problems):
        torch.testing.assert_close(out, launch_scaled_mm(a, p.b, scale_a, p.scale_b, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_sums_each_members_slices(dtype, split_k):
    """K split over programs: each member's slices in its own slab of the partial buffer, its
    tiles' tickets apart from the others'; bit for bit the plain kernel's split (5 K blocks in
    4 splits: the last one empty)."""
    Ns, K = [40, 100, 24], 130
    a, scale_a, problems = _members(5, Ns, K, dtype, 0)
    cfg = configs.Config(16, 32, 32, split_k=split_k)
    outs = launch_scaled_mm_group(a, [p.b for p in problems], scale_a, [p.scale_b for p in problems],
                                  torch.bfloat16, [p.bias for p in problems], config=cfg)
    for out, p in zip(outs, problems):
        want = launch_scaled_mm(a, p.b, scale_a, p.scale_b, torch.bfloat16, p.bias, config=cfg)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        unsplit = launch_scaled_mm(a, p.b, scale_a, p.scale_b, torch.bfloat16, p.bias,
                                   config=dataclasses.replace(cfg, split_k=1))
        exact = dict(rtol=0, atol=0) if dtype == torch.int8 else {}  # (int32 sums: in any order)
        torch.testing.assert_close(out, unsplit, **exact)


def test_split_k_slices_land_in_each_members_slab(monkeypatch):
    """The partial buffer after a split launch: member i's (SPLIT_K, M, N_i) slices from the
    columns before it on (SPLIT_K * M * sum(N_j < i)), slice s the exact int32 sum over the
    s-th run of K blocks; every ticket handed back zeroed. (The interpreter runs a tile's
    splits one after another, so slabs that overlapped would still sum right there.)"""
    from fusepass.kernels import group_launch

    kept, buffers = [], group_launch.split_k_buffers

    def keep(*args):
        kept.append(buffers(*args))
        return kept[-1]

    monkeypatch.setattr(group_launch, "split_k_buffers", keep)
    Ns, K, M, split = [40, 100, 24, 17], 130, 5, 3  # (four members: each branch of the kernel)
    a, scale_a, problems = _members(M, Ns, K, torch.int8, 0)
    launch_scaled_mm_group(a, [p.b for p in problems], scale_a, [p.scale_b for p in problems],
                           torch.bfloat16, [p.bias for p in problems], config=configs.Config(16, 32, 32, split_k=split))
    (partial, tickets), = kept
    assert not tickets.any()
    blocks = -(-K // 32)
    per = -(-blocks // split)
    col0 = 0
    for N, p in zip(Ns, problems):
        slab = partial.flatten()[split * M * col0:split * M * (col0 + N)].view(split, M, N)
        for s in range(split):
            lo, hi = min(s * per, blocks) * 32, min((s + 1) * per * 32, K)
            want = a[:, lo:hi].int().cpu() @ p.b[lo:hi].int().cpu()
            torch.testing.assert_close(slab[s].cpu(), want, rtol=0, atol=0)
        col0 += N


def test_config_is_the_fused_weights_with_pointer_loads(monkeypatch):
    """The joined weight's config: its tuned or derived split where a decode launch may split
    (every M <= 16 bucket here: the built-in tiles leave the SMs idle), none where it may not;
    a TMA (or persistent) config's tiles with pointer loads."""
    cpu = torch.device("cpu")
    qkv = (16, [4096, 1024, 1024], 4096, torch.int8, cpu)
    cfg = group_config(*qkv, k_contiguous=True)
    assert cfg == configs.select_config(16, 6144, 4096, torch.int8, cpu) and cfg.split_k > 1
    assert group_config(*qkv, k_contiguous=True, split_decode=False).split_k == 1
    from fusepass.kernels import group_launch

    persistent = configs.Config(128, 128, 128, tma=True, persistent=True)
    monkeypatch.setattr(group_launch, "select_config", lambda *args, **kwargs: persistent)
    assert group_config(64, [4096, 1024, 1024], 4096, torch.int8, cpu, k_contiguous=True) == \
        dataclasses.replace(persistent, tma=False, persistent=False)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("K", [300, 1024])  # (1024: whole blocks, dp4a where compiled)
def test_one_row_of_weights_as_stored_runs_each_members_gemv(dtype, variant, K):
    """M = 1, b = w.t(): the members' rows of b.T (gemv.py's loop), each member bit for bit the
    M = 1 kernel's result; ragged N, K over several blocks, ragged or whole."""
    Ns = [40, 17, 24]
    a, scale_a, problems = _members(1, Ns, K, dtype, variant)
    rows = (8, 4)[variant % 2]
    cfg = dataclasses.replace(gemv_config(sum(Ns), K, 1, dtype), block_n=rows, block_k=128)
    assert cfg.gemv
    outs = launch_scaled_mm_group(a, [p.b for p in problems], scale_a, [p.scale_b for p in problems],
                                  torch.bfloat16, [p.bias for p in problems], config=cfg)
    for out, p in zip(outs, problems):
        want = launch_scaled_mm(a, p.b, scale_a, p.scale_b, torch.bfloat16, p.bias, config=cfg)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_one_row_takes_the_gemv_where_the_joined_width_fills_the_gpu():
    cpu = torch.device("cpu")  # (DEFAULT_SMS: 132)
    qkv = ([4096, 1024, 1024], 4096)
    assert group_config(1, *qkv, torch.int8, cpu, k_contiguous=True) == gemv_config(6144, 4096, configs.DEFAULT_SMS, torch.int8)
    assert not group_config(2, *qkv, torch.int8, cpu, k_contiguous=True).gemv  # two rows
    assert not group_config(1, *qkv, torch.int8, cpu, k_contiguous=False).gemv  # weights stored (K, N)
    assert not group_config(1, [512, 512], 4096, torch.int8, cpu, k_contiguous=True).gemv  # 256 programs of 4 rows
    assert group_config(1, [1024, 1024], 4096, torch.int8, cpu, k_contiguous=True).gemv  # 512


@pytest.mark.parametrize("M,split_k", [(2, 1), (1, 2)], ids=["two-rows", "split"])
def test_a_gemv_config_refuses_two_rows_or_a_split(M, split_k):
    """As launch.plan does: the M = 1 kernel's rows have no split (a split config used to run unsplit)."""
    a, scale_a, problems = _members(M, [16, 16], 64, torch.int8, 0)
    cfg = dataclasses.replace(gemv_config(32, 64, 1, torch.int8), split_k=split_k)
    with pytest.raises(ValueError, match=rf"a gemv config needs M = 1, .* got M = {M}, .* split_k {split_k}"):
        launch_scaled_mm_group(a, [p.b for p in problems], scale_a, [p.scale_b for p in problems],
                               torch.float32, [None, None], config=cfg)
