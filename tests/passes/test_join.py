"""passes/join.py: sibling fused matmuls over touching row ranges of one buffer become one.

Graph tests on ``W8A8Linear``s (fusepass.prepare's modules) sharing a ``Joint``: what joins
(counts, the graph, numerics against eager) and what must not (other activations, ranges
that do not touch, separate buffers, bounds counted from the end); block-wise fp8 siblings,
whose weight scale is cut by rows of 128x128 blocks.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from torch import nn

from fusepass.integrations.linear import Act, Joint, W8A8Linear
from fusepass.passes import PassConfig
from fusepass.passes.join import NAME as JOINED
from fusepass.passes.quantize_in import GROUPS_NAME as GROUPS_IN

from tests.passes.harness import run_pass

K = 64
BK = 256  # the block-wise tests' K: two 128-wide groups
FP8_BLOCK = Act("fp8-block", 448.0)


def _joint(rows: list[int], act: Act, bias: bool = False, seed: int = 0, k: int = BK) -> tuple[Joint, list[W8A8Linear]]:
    g = torch.Generator().manual_seed(seed)
    n = sum(rows)
    if act.kind == "fp8-block":  # (one scale per 128x128 block)
        w = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(n // 128, k // 128, generator=g) / 100 + 1e-3
    else:
        w = torch.randint(-127, 128, (n, K), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / 100 + 1e-3
    joint = Joint(w, scale, w.sum(1, dtype=torch.int32) if act.kind == "int8-asym" else None,
                  torch.randn(n, generator=g).bfloat16() if bias else None)
    members, lo = [], 0
    for r in rows:
        members.append(W8A8Linear(joint, lo, lo + r, act))
        lo += r
    return joint, members


class Siblings(nn.Module):
    """Calls ``members[i]`` on ``inputs[i]`` (an index into the forward's arguments)."""

    def __init__(self, members, inputs):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.inputs = inputs

    def forward(self, *xs):
        return [m(xs[i]) for m, i in zip(self.members, self.inputs, strict=True)]


# Where a join does not take siblings at _x's 32 rows, a group would (up to group_max_m)
UNGROUPED = PassConfig(group_max_m=16)


def _x(m: int = 32, seed: int = 1, k: int = K):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _calls(after: str) -> int:
    return len(re.findall(r"= fusepass\.scaled_mm(?:_azp)?\(", after))


def _check_eager(model, xs, out):
    with torch.no_grad():
        eager = model(*xs)
    for o, e in zip(out, eager, strict=True):
        assert o.shape == e.shape and o.dtype == e.dtype
        torch.testing.assert_close(o.float(), e.float(), rtol=2e-2, atol=2e-2)


def test_three_siblings_on_one_activation_become_one_matmul():
    _, members = _joint([32, 16, 16], Act("int8"))
    model, x = Siblings(members, [0, 0, 0]), _x()
    r = run_pass(model, x)
    assert r.counts == {"dequant_mm": 3, JOINED: 1}, r.counts
    assert _calls(r.after) == 1
    # one call over rows [0, 64) of the buffer, each member a column slice of its result
    assert re.search(r"slice\.Tensor\(\w+weight, 0, 0, 64\)", r.after), r.after
    for lo, hi in ((0, 32), (32, 48), (48, 64)):
        assert re.search(rf"slice\.Tensor\(scaled_mm\w*, 1, {lo}, {hi}\)", r.after), r.after
    _check_eager(model, [x], r.out)


def test_asymmetric_siblings_join_with_their_row_sums_and_bias():
    _, members = _joint([16, 16], Act("int8-asym"), bias=True)
    model, x = Siblings(members, [0, 0]), _x(m=20)  # (M > 16: per-token zero points)
    r = run_pass(model, x)
    assert r.counts == {"int_mm_azp_per_token": 2, JOINED: 1}, r.counts
    assert len(re.findall(r"= fusepass\.scaled_mm_azp\(", r.after)) == 1
    _check_eager(model, [x], r.out)


def test_siblings_in_any_order_join_over_the_union():
    _, members = _joint([16, 16, 16], Act("int8"))
    model, x = Siblings([members[2], members[0], members[1]], [0, 0, 0]), _x()
    r = run_pass(model, x)
    assert r.counts == {"dequant_mm": 3, JOINED: 1}, r.counts
    _check_eager(model, [x], r.out)


def test_ranges_that_do_not_touch_are_not_joined():
    _, members = _joint([16, 16, 16], Act("int8"))
    model, x = Siblings([members[0], members[2]], [0, 0]), _x()
    r = run_pass(model, x, config=UNGROUPED)
    assert r.counts == {"dequant_mm": 2, "shared_activation": 1}, r.counts
    assert _calls(r.after) == 2


def test_siblings_on_different_activations_are_not_joined():
    _, members = _joint([16, 16], Act("int8"))
    model = Siblings(members, [0, 1])
    r = run_pass(model, _x(seed=1), _x(seed=2))
    assert r.counts == {"dequant_mm": 2}, r.counts


def test_separate_buffers_are_not_joined():
    _, (a,) = _joint([16], Act("int8"), seed=1)
    _, (b,) = _joint([16], Act("int8"), seed=2)
    r = run_pass(Siblings([a, b], [0, 0]), _x(), config=UNGROUPED)
    assert r.counts == {"dequant_mm": 2, "shared_activation": 1}, r.counts


def test_negative_bounds_are_not_joined():
    """``w[32:-16]`` counts from the end: left alone, never read as an empty range."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (64, K), generator=g, dtype=torch.int8)
    s = torch.rand(64, generator=g) / 100 + 1e-3

    def two(xq, xs, w, s):
        return [torch.ops.fusepass.scaled_mm(xq, w[0:32].t(), xs, s[0:32], torch.bfloat16),
                torch.ops.fusepass.scaled_mm(xq, w[32:-16].t(), xs, s[32:-16], torch.bfloat16)]

    xq = torch.randint(-127, 128, (32, K), generator=g, dtype=torch.int8)
    xs = torch.rand(32, 1, generator=g)
    r = run_pass(two, xq, xs, w, s)
    assert JOINED not in r.counts, r.counts
    assert [tuple(o.shape) for o in r.out] == [(32, 32), (32, 16)]


@pytest.mark.parametrize("rows,k", [([256, 128, 128], 256), ([128, 128], 256), ([128, 256], 256),
                                    ([256, 128], 128)])
@pytest.mark.parametrize("m", [1, 32])
def test_blockwise_siblings_join_over_their_rows_of_blocks(m, rows, k):
    """A prepared FP8_BLOCK layer's q/k/v (and gate/up): one call over the union's weight rows
    and rows of blocks of its scale; at M = 1 too, where a member of one row of blocks (or
    each, at one 128-wide group of K) reads its scale as a view, not a transpose; the first
    member's scale, a slice of the buffer's first rows, found whole."""
    _, members = _joint(rows, FP8_BLOCK, bias=True, k=k)
    model, x = Siblings(members, [0] * len(rows)), _x(m, k=k)
    r = run_pass(model, x)
    # (at M = 1 the joined call also quantizes its row's groups in its launch: quantize_in.py)
    in_launch = {GROUPS_IN: 1} if m == 1 else {}
    assert r.counts == {"dequant_mm_blockwise": len(rows), JOINED: 1, **in_launch}, r.counts
    assert len(re.findall(r"= fusepass\.scaled_mm_blockwise(_dynamic)?\(", r.after)) == 1, r.after
    assert re.search(rf"slice\.Tensor\(\w+weight_scale, 0, 0, {sum(rows) // 128}\)", r.after), r.after
    _check_eager(model, [x], r.out)


def test_blockwise_scales_from_another_buffer_are_not_joined():
    """Block-wise siblings over one weight buffer whose scales are in two buffers stay apart."""
    joint, (a, b) = _joint([256, 128], FP8_BLOCK)
    other = Joint(joint.weight, joint.weight_scale.clone())
    r = run_pass(Siblings([a, W8A8Linear(other, 256, 384, FP8_BLOCK)], [0, 0]), _x(1, k=BK))
    # (each quantizes the row's groups in its own M = 1 launch; without that, one quantization shared)
    assert r.counts == {"dequant_mm_blockwise": 2, GROUPS_IN: 2}, r.counts
    r = run_pass(Siblings([a, W8A8Linear(other, 256, 384, FP8_BLOCK)], [0, 0]), _x(1, k=BK),
                 config=PassConfig(quantize_groups_in_gemv=False))
    assert r.counts == {"dequant_mm_blockwise": 2, "shared_activation": 1}, r.counts


def test_join_off_in_the_config():
    _, members = _joint([16, 16], Act("int8"))
    r = run_pass(Siblings(members, [0, 0]), _x(m=32), config=replace(UNGROUPED, join_siblings=False))
    assert r.counts == {"dequant_mm": 2, "shared_activation": 1}, r.counts
