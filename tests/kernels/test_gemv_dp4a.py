"""``gemv.py``'s DP4A path in Triton's interpreter, which runs no PTX: ``dp4a`` as four
sign-extended byte products a word, the launch deciding as compiled code does. int32 sums
exact against float64; quantizing and gated rows equal to the loop without it; the grouped
kernel's members. On a GPU PTX's own ``dp4a`` runs where the kernel tests take whole blocks
(against the float64 oracle: ``test_gemv_kernel``'s and the sanitizer sweep's; against the
same kernel: ``test_scaled_mm_dynamic``'s and ``test_group_kernel``'s)."""

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from fusepass.kernels import gemv, group_launch, launch, launch_scaled_mm
from fusepass.kernels.configs import GEMV
from fusepass.kernels.group_launch import launch_scaled_mm_group

ROWS_8x256 = replace(GEMV, block_n=8, block_k=256)


@triton.jit
def _dp4a_by_bytes(w, x, acc):
    for i in tl.static_range(4):
        acc += ((w << (24 - 8 * i)) >> 24) * ((x << (24 - 8 * i)) >> 24)
    return acc


@pytest.fixture
def taken(monkeypatch):
    """The launches' DP4A decisions, in order (dp4a emulated, the interpreter's veto lifted)."""
    if not launch.INTERPRETED:
        pytest.skip("compiled: PTX's dp4a runs in the oracle tests")
    monkeypatch.setattr(gemv, "_dp4a", _dp4a_by_bytes)
    monkeypatch.setattr(launch, "INTERPRETED", False)
    seen, real = [], launch.dp4a_rows

    def recorded(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(launch, "dp4a_rows", recorded)
    monkeypatch.setattr(group_launch, "dp4a_rows", recorded)
    return seen


def _bytes(*shape, g):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)


def _exact(a, b):
    return (a.double() @ b.double()).to(torch.int32)


@pytest.mark.parametrize("N,a_stride", [(45, 3), (40, 1)])  # (45: ragged rows read row 0 again)
def test_int32_sums_are_exact(taken, N, a_stride):
    g = torch.Generator().manual_seed(N)
    b = _bytes(N, 1024, g=g).t()
    a = _bytes(1, 1024 * a_stride, g=g)[:, ::a_stride]
    assert torch.equal(launch_scaled_mm(a, b, None, None, torch.int32, config=ROWS_8x256), _exact(a, b))
    lows = torch.full((1, 1024), -128, dtype=torch.int8)
    for row in (lows, torch.full((1, 1024), 127, dtype=torch.int8)):  # (the largest sums both ways)
        out = launch_scaled_mm(row, lows.expand(N, 1024).t(), None, None, torch.int32, config=ROWS_8x256)
        assert torch.equal(out, _exact(row, lows.expand(N, 1024).t()))
    assert taken == [True] * 3


@pytest.mark.parametrize("gated", [False, True])
def test_quantizing_and_gated_rows_are_the_loops_without_it(taken, monkeypatch, gated):
    g = torch.Generator().manual_seed(1)
    b, sb = _bytes(45, 1024, g=g).t(), torch.rand(45, generator=g)
    rows = (torch.randn(1, 2048, generator=g) * 3).to(torch.bfloat16)
    x, gate = (rows[:, 1::2], rows[:, ::2]) if gated else (rows[:, 1::2], None)  # strided, interleaved

    def run():
        return launch.launch_gemv_quantized(x, b, sb, torch.float32, None, 127.5, 1e-7, gate=gate)

    with_words = run()
    monkeypatch.setattr(launch, "INTERPRETED", True)
    assert torch.equal(with_words, run()) and taken == [True, False]


def test_the_grouped_rows_take_it_where_every_member_is_aligned(taken):
    g = torch.Generator().manual_seed(2)
    a, Ns = _bytes(1, 1024, g=g), [40, 17, 24]
    aligned = [_bytes(n, 1024, g=g).t() for n in Ns]
    spare = _bytes(24 * 1024 + 4, g=g)
    off = spare[4:].view(24, 1024).t()  # (the members' layout, from 4 bytes past a 16-byte boundary)
    for bs in (aligned, aligned[:2] + [off]):
        outs = launch_scaled_mm_group(a, bs, torch.ones(1), [torch.ones(n) for n in Ns], torch.float32,
                                      [None] * 3, config=ROWS_8x256)
        assert all(torch.equal(out, _exact(a, b).float()) for out, b in zip(outs, bs))
    assert taken == [True, True, True, True, True, False]  # (a member each; the second group stops at off)


@pytest.mark.parametrize("K", [1, 2])
def test_a_block_shorter_than_a_word_does_not_take_it(taken, K):
    g = torch.Generator().manual_seed(K)
    b, a = _bytes(45, 8, g=g)[:, :K].t(), _bytes(1, K, g=g)  # rows 8 bytes apart
    out = launch_scaled_mm(a, b, None, None, torch.int32, config=replace(GEMV, block_n=8, block_k=K))
    assert torch.equal(out, _exact(a, b)) and taken == [False]
