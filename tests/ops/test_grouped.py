"""``fusepass.scaled_grouped_mm``: a mixture of experts' W8A8 matmul (each row times its
expert's weight), against a float64 oracle at every M (tokens x top-k, experts with no rows
among them), E in {8, 64, 128}, top-k in {1, 2, 8}; the fake, opcheck, a trace with no
data-dependent shape, and an error naming the argument for every bad input. On CPU this runs
the reference; the kernels: tests/kernels/test_grouped_kernel.py (and on a GPU, here too)."""

import pytest
import torch

import fusepass
from tests.support.grouped_data import make_grouped, oracle
from tests.support.helpers import FP8_MMA_REL, HALF_ULP

OP = torch.ops.fusepass.scaled_grouped_mm.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_matches_oracle(out, p, out_dtype, half_ulps=1):
    """Within ``half_ulps`` half-ulps of ``out_dtype`` (one rounding) and fp32's sums of the oracle."""
    value, mag = oracle(p)
    rel = 2.0**-20 if p.a.dtype == torch.int8 else FP8_MMA_REL  # (fp32 sums of fp8 products: their order)
    out = out.cpu().double()
    nan = value.isnan()
    assert out[nan].isnan().all(), "a row with no valid expert must be NaN"
    err = (out - value)[~nan].abs()
    bound = (half_ulps * HALF_ULP[out_dtype] * value.abs() + rel * mag + 1e-30)[~nan]
    assert (err <= bound).all(), f"max error / bound {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("E", [8, 64, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_matches_the_float64_oracle(dtype, E, top_k, tokens):
    p = make_grouped(tokens, top_k, E, 48, 160, dtype, device=DEVICE, seed=E + top_k + tokens)
    hit = p.expert_ids.unique().numel()
    assert hit < E or tokens * top_k >= E  # (experts with no rows: E = 64, 128 at every size here)
    assert_matches_oracle(fusepass.scaled_grouped_mm(*p.args()), p, torch.bfloat16)


@pytest.mark.parametrize("variant", [
    dict(bias=False, row_weights=False), dict(scale_a_shape=()), dict(scale_a_shape=(1,)), dict(scale_b_shape=(4,)),
    dict(scale_b_shape=(4, 1)), dict(ids_dtype=torch.int32)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_epilogue_variant(variant, out_dtype):
    p = make_grouped(5, 2, 4, 40, 72, device=DEVICE, seed=3, **variant)
    out = fusepass.scaled_grouped_mm(*p.args(out_dtype))
    assert out.dtype == out_dtype and out.shape == (10, 40) and out.is_contiguous()
    assert_matches_oracle(out, p, out_dtype)


def test_a_row_with_an_expert_outside_the_range_is_nan():
    p = make_grouped(4, 2, 8, 32, 64, device=DEVICE, seed=1)
    p.expert_ids[3], p.expert_ids[5] = 8, -1
    out = fusepass.scaled_grouped_mm(*p.args())
    assert out[3].isnan().all() and out[5].isnan().all() and not out[[0, 1, 2, 4, 6, 7]].isnan().any()
    assert_matches_oracle(out, p, torch.bfloat16)


@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block-scales"])
def test_no_rows(blocks):
    p = make_grouped(0, 8, 8, 32, 64, torch.float8_e4m3fn if blocks else torch.int8, device=DEVICE, blocks=blocks)
    assert fusepass.scaled_grouped_mm(*p.args()).shape == (0, 32)


def test_the_weights_in_any_stride_order():
    p = make_grouped(6, 2, 4, 48, 96, device=DEVICE, seed=2)
    want = fusepass.scaled_grouped_mm(*p.args())
    p.b = p.b.contiguous()  # [E, K, N] row-major instead of the stored [E, N, K]'s transpose
    torch.testing.assert_close(fusepass.scaled_grouped_mm(*p.args()), want, rtol=0, atol=0)


def test_fake_and_opcheck():
    p = make_grouped(3, 2, 4, 32, 64, seed=4)
    torch.library.opcheck(OP, p.args(), test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                     "test_aot_dispatch_dynamic"))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = OP(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in p.args()])
    assert fake.shape == (6, 32) and fake.dtype == torch.bfloat16


def test_traces_with_no_data_dependent_shape():
    """Under torch.compile, fullgraph: one op node, no graph break (a CUDA-graph step needs the same)."""
    p = make_grouped(3, 2, 4, 32, 64, seed=5)
    fn = torch.compile(lambda *args: fusepass.scaled_grouped_mm(*args), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(*p.args()), fusepass.scaled_grouped_mm(*p.args()), rtol=0, atol=0)


def _bad(**change):
    p = make_grouped(3, 2, 4, 32, 64, seed=6)
    args = dict(zip(("a", "b", "scale_a", "scale_b", "expert_ids", "out_dtype", "bias", "row_weights"), p.args()))
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,message", [
    (dict(a=torch.zeros(6, 64)), TypeError, "`a` must have dtype int8, float8_e4m3fn"),
    (dict(b=torch.zeros(4, 64, 32, dtype=torch.float8_e4m3fn)), TypeError, "`b` must have the dtype of `a`"),
    (dict(b=torch.zeros(64, 32, dtype=torch.int8)), ValueError, "`b` must be 3-D [E, K, N]"),
    (dict(b=torch.zeros(4, 63, 32, dtype=torch.int8)), ValueError, "`b` must be [E, K, N] with K = 64"),
    (dict(scale_a=torch.ones(5)), ValueError, "`scale_a` must hold one value or one per row of `a` (M = 6)"),
    (dict(scale_b=torch.ones(4, 31)), ValueError, "`scale_b` must be per expert and channel [E, N] = [4, 32]"),
    (dict(scale_b=torch.ones(4, 32, dtype=torch.int32)), TypeError, "`scale_b` must have dtype float32"),
    (dict(expert_ids=torch.zeros(6)), TypeError, "`expert_ids` must have dtype int32, int64"),
    (dict(expert_ids=torch.zeros(5, dtype=torch.int64)), ValueError,
     "`expert_ids` must be [M]: one expert a row of `a` (M = 6), or a whole number of experts for each (M a multiple "
     "of 6: a top-k router's k rows a token); got shape (5,)"),
    (dict(expert_ids=torch.zeros(6, 1, dtype=torch.int64)), ValueError, "`expert_ids` must be [M]: one expert a row"),
    (dict(bias=torch.zeros(32)), ValueError, "`bias` must be [E, N] = [4, 32]"),
    (dict(row_weights=torch.ones(7)), ValueError, "`row_weights` must be [M] or [M, 1] with M = 6"),
    (dict(out_dtype=torch.int8), TypeError, "`out_dtype` must be one of bfloat16, float16, float32"),
    (dict(a=torch.zeros(6, 200000, dtype=torch.int8), b=torch.zeros(4, 200000, 32, dtype=torch.int8)), ValueError,
     "K = 200000 is too large for exact int32 accumulation"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_names_the_argument(change, error, message):
    with pytest.raises(error, match="^fusepass.scaled_grouped_mm: " + __import__("re").escape(message)):
        fusepass.scaled_grouped_mm(**_bad(**change))


@pytest.mark.parametrize("tokens,top_k,E,N,K", [(1, 8, 16, 200, 300), (5, 2, 4, 128, 256), (20, 2, 8, 136, 130)])
def test_block_scales_match_the_float64_oracle(tokens, top_k, E, N, K):
    p = make_grouped(tokens, top_k, E, N, K, torch.float8_e4m3fn, device=DEVICE, seed=tokens + K, blocks=True)
    assert p.scale_b.stride(1) == 1 or p.scale_b.shape[2] == 1  # (the stored [E, N/128, K/128]'s transpose)
    assert_matches_oracle(fusepass.scaled_grouped_mm(*p.args()), p, torch.bfloat16)


@pytest.mark.parametrize("change,message", [
    (lambda p: (setattr(p, "a", p.a.to(torch.float32).to(torch.int8)), setattr(p, "b", p.b.to(torch.float32).to(torch.int8))),
     "block scales .* are for float8_e4m3fn operands"),
    (lambda p: setattr(p, "scale_a", p.scale_a[:, :1]), r"`scale_a` must be \[6, 3\] \(one per 1x128 group of a row"),
    (lambda p: setattr(p, "scale_b", p.scale_b[:, :, :1]), r"`scale_b` must be \[4, 3, 2\] \(one per 128x128 block"),
    (lambda p: setattr(p, "scale_b", p.scale_b.to(torch.bfloat16)), "scale_b"),
])
def test_bad_block_scales_are_errors_naming_the_argument(change, message):
    p = make_grouped(3, 2, 4, 200, 300, torch.float8_e4m3fn, seed=5, blocks=True)
    change(p)
    with pytest.raises((ValueError, TypeError), match=message):
        fusepass.scaled_grouped_mm(*p.args())


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (5, 2), (12, 4)])
@pytest.mark.parametrize("blocks", [False, True], ids=["per-row", "block-scales"])
def test_a_row_of_a_shared_by_its_tokens_routed_rows(tokens, top_k, blocks):
    # ``a`` of one row a token, M = tokens * top_k routed rows: the same as each row repeated
    dtype = torch.float8_e4m3fn if blocks else torch.int8
    p = make_grouped(tokens, top_k, 8, 200, 300, dtype, device=DEVICE, seed=tokens, blocks=blocks)
    shared = make_grouped(tokens, top_k, 8, 200, 300, dtype, device=DEVICE, seed=tokens, blocks=blocks)
    shared.a, shared.scale_a = p.a[::top_k].clone(), p.scale_a[::top_k].clone()
    p.a, p.scale_a = shared.a.repeat_interleave(top_k, 0), shared.scale_a.repeat_interleave(top_k, 0)
    out = fusepass.scaled_grouped_mm(*shared.args())
    assert out.shape == (tokens * top_k, 200)
    torch.testing.assert_close(out, fusepass.scaled_grouped_mm(*p.args()), rtol=0, atol=0)
    assert_matches_oracle(out, p, torch.bfloat16)


# fusepass.route_experts: the sorted blocks' rows, made once for a layer's two grouped matmuls

ROUTE = torch.ops.fusepass.route_experts.default


@pytest.mark.parametrize("M,E,block_m", [(0, 4, 16), (6, 4, 16), (40, 8, 16), (300, 128, 64), (130, 3, 4)])
def test_route_experts_is_the_stable_sort_in_padded_blocks(M, E, block_m):
    g = torch.Generator().manual_seed(M + E)
    ids = torch.randint(-1, E + 1, (M,), generator=g)  # (ids outside [0, E): one group, last)
    rows, blocks = fusepass.route_experts(ids.to(DEVICE), E, block_m)
    assert rows.dtype == blocks.dtype == torch.int32 and rows.numel() == blocks.numel() * block_m
    rows, blocks = rows.cpu(), blocks.cpu()
    placed = rows[rows < M]
    assert sorted(placed.tolist()) == list(range(M))  # every row once
    key = torch.where((ids >= 0) & (ids < E), ids, E)
    assert torch.equal(placed.long(), torch.argsort(key, stable=True))  # by expert, each expert's in their order
    for i, r in enumerate(rows.tolist()):  # each row in a block of its own group; padding is the row M
        assert r == M or key[r] == blocks[i // block_m]
    used = int(((torch.bincount(key, minlength=E + 1) + block_m - 1) // block_m).sum())
    assert blocks[:used].tolist() == sorted(blocks[:used].tolist()) and (blocks[used:] == E + 1).all()


def test_route_experts_fake_and_opcheck():
    ids = torch.tensor([3, 0, 1, 1, 7, -1])
    torch.library.opcheck(ROUTE, (ids, 4, 16), test_utils=("test_schema", "test_autograd_registration",
                                                            "test_faketensor", "test_aot_dispatch_dynamic"))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        rows, blocks = ROUTE(mode.from_tensor(ids), 4, 16)
    assert rows.shape == (96,) and blocks.shape == (6,) and rows.dtype == torch.int32  # ((6 + 5 * 15 + 15) // 16)


@pytest.mark.parametrize("args,error,message", [
    ((torch.zeros(4), 4, 16), TypeError, "`expert_ids` must have dtype int32, int64"),
    ((torch.zeros(2, 2, dtype=torch.int64), 4, 16), ValueError, "`expert_ids` must be [M]"),
    ((torch.zeros(4, dtype=torch.int64), 0, 16), ValueError, "`num_experts` must be an int >= 1; got 0"),
    ((torch.zeros(4, dtype=torch.int64), 4, 24), ValueError, "`block_m` must be a power of two"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_route_experts_bad_input_names_the_argument(args, error, message):
    with pytest.raises(error, match="^fusepass.route_experts: " + __import__("re").escape(message)):
        fusepass.route_experts(*args)


@pytest.mark.parametrize("op", ["scaled_grouped_mm", "scaled_grouped_mm_dynamic"])
def test_the_ops_take_a_route_and_give_what_they_give_without(op):
    p = make_grouped(24, 2, 8, 32, 64, device=DEVICE, seed=11)  # (48 routed rows: the sorted blocks on a GPU)
    rows, blocks = fusepass.route_experts(p.expert_ids, 8, 16)
    if op == "scaled_grouped_mm":
        args = p.args()
    else:  # (float rows, as down's: the op quantizes them)
        x = torch.randn(48, 64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1)).to(torch.bfloat16)
        args = (x, p.b, p.scale_b.reshape(8, -1), p.expert_ids, torch.bfloat16, p.bias, p.row_weights)
    fn = getattr(fusepass, op)
    want = fn(*args)
    torch.testing.assert_close(fn(*args, sorted_rows=rows, block_experts=blocks), want, rtol=0, atol=0)
    got = getattr(torch.ops.fusepass, op)(*args, sorted_rows=rows, block_experts=blocks)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_ops_with_a_route_pass_opcheck():
    p = make_grouped(24, 2, 8, 32, 64, seed=12)
    rows, blocks = fusepass.route_experts(p.expert_ids, 8, 16)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(OP, (*p.args(), rows, blocks), test_utils=utils)
    torch.library.opcheck(torch.ops.fusepass.scaled_grouped_mm_dynamic.default,
                          (x, p.b, p.scale_b.reshape(8, -1), p.expert_ids, torch.bfloat16),
                          dict(sorted_rows=rows, block_experts=blocks), test_utils=utils)


def test_the_dynamic_op_refuses_a_route_of_other_ids_by_its_own_name():
    p = make_grouped(24, 2, 8, 32, 64, seed=13)
    rows, blocks = fusepass.route_experts(p.expert_ids.flip(0), 8, 16)
    x = torch.randn(48, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^fusepass.scaled_grouped_mm_dynamic: `sorted_rows` and `block_experts` "
                                         r"are not route_experts\(expert_ids, 8, block_m\)'s of these `expert_ids`"):
        fusepass.scaled_grouped_mm_dynamic(x, p.b, p.scale_b.reshape(8, -1), p.expert_ids, torch.bfloat16,
                                           sorted_rows=rows, block_experts=blocks)


@pytest.mark.parametrize("change,message", [
    (dict(sorted_rows=torch.zeros(80, dtype=torch.int32)), "`sorted_rows` and `block_experts` come together "
                                                            "(route_experts' two tensors); got only `sorted_rows`"),
    (dict(sorted_rows=torch.zeros(80, dtype=torch.int64), block_experts=torch.zeros(5, dtype=torch.int32)),
     "`sorted_rows` must have dtype int32"),
    (dict(sorted_rows=torch.zeros(64, dtype=torch.int32), block_experts=torch.zeros(4, dtype=torch.int32)),
     "`sorted_rows` and `block_experts` must be route_experts(expert_ids, 4, block_m)'s at M = 6 rows"),
    (dict(sorted_rows=torch.zeros(96, dtype=torch.int32), block_experts=torch.zeros(6, dtype=torch.int32)),
     "`sorted_rows` and `block_experts` are not route_experts(expert_ids, 4, block_m)'s of these `expert_ids`"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_route_names_the_argument(change, message):
    error = TypeError if "dtype" in message else ValueError
    with pytest.raises(error, match="^fusepass.scaled_grouped_mm: " + __import__("re").escape(message)):
        fusepass.scaled_grouped_mm(**_bad(**change))
