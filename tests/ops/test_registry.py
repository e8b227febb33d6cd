"""The one way ops are registered (``fusepass.ops.registry``): every op has its own fake,
its implementation in ``IMPLS``, no gradient, and its Python wrapper's dispatch."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusepass.ops  # noqa: F401  (registers the ops)
from fusepass.ops import reference, registry

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def _args(op: str):
    """Valid CPU arguments of ``op`` (M = 3, K = 256, N = 128)."""
    M, K, N = 3, 256, 128
    a8, b8 = torch.zeros(M, K, dtype=torch.int8), torch.zeros(N, K, dtype=torch.int8).t()
    af, bf = a8.to(E4M3), b8.to(E4M3)
    x = torch.randn(M, K, dtype=BF16)
    sa, sb = torch.ones(M, 1), torch.ones(1, N)
    return {
        "scaled_mm": (a8, b8, sa, sb, BF16, None),
        "scaled_mm_azp": (a8, b8, sa, sb, BF16, torch.zeros(N, dtype=torch.int32), None, None),
        "int_mm": (a8, b8),
        "scaled_mm_blockwise": (af, bf, torch.ones(M, K // 128), torch.ones(K // 128, 1), BF16, None),
        "scaled_mm_blockwise_dynamic": (x, bf, torch.ones(K // 128, 1), BF16, None, 1e-12),
        "scaled_mm_dynamic": (x, b8, sb, BF16, None, 127.5, 1e-12, None, None),
        "scaled_mm_group": (a8, [b8, b8], sa, [sb, sb], BF16, [None, None]),
        "scaled_grouped_mm": (a8, torch.stack([b8, b8]), sa, torch.ones(2, N), torch.tensor([0, 1, 1]), BF16, None, None),
        "scaled_grouped_mm_dynamic": (x, torch.stack([b8, b8]), torch.ones(2, N), torch.tensor([0, 1, 1]), BF16, None,
                                      None, 127.5, 1e-12, x, None),
        "route_experts": (torch.tensor([0, 1, 1]), 2, 16),
    }[op]


def _fake(mode, args) -> list:
    one = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return [[one(u) for u in t] if isinstance(t, list) else one(t) for t in args]


OPS = sorted(str(op).removeprefix("fusepass.").removesuffix(".default") for op in registry.IMPLS)


def test_every_op_is_registered_one_way():
    assert OPS == ["int_mm", "route_experts", "scaled_grouped_mm", "scaled_grouped_mm_dynamic", "scaled_mm",
                   "scaled_mm_azp", "scaled_mm_blockwise", "scaled_mm_blockwise_dynamic", "scaled_mm_dynamic",
                   "scaled_mm_group"]
    for name in OPS:
        assert getattr(fusepass.ops, name).__doc__  # its Python wrapper, documented


@pytest.mark.parametrize("op", OPS)
def test_fake_runs_no_arithmetic(op, monkeypatch):
    """A fake call gives the output's metadata from the op's own fake: the implementation (here
    the CPU reference) never runs. The default fake of a triton_op ran it, 6 ms a call."""
    def refuse(*args, **kwargs):
        raise AssertionError("the implementation ran under fake tensors")
    for name in ("accumulate", "scaled_mm", "scaled_mm_azp", "scaled_mm_blockwise", "scaled_grouped_mm",
                 "route_experts"):
        monkeypatch.setattr(reference, name, refuse)
    mode = FakeTensorMode()
    with mode:
        out = getattr(torch.ops.fusepass, op)(*_fake(mode, _args(op)))
    outs = out if isinstance(out, list) else [out]
    if op == "route_experts":  # (3 rows, 2 experts: 3 blocks of 16 rows)
        assert [tuple(o.shape) for o in outs] == [(48,), (3,)] and {o.dtype for o in outs} == {torch.int32}
        return
    assert [tuple(o.shape) for o in outs] == [(3, 128)] * len(outs)
    assert {o.dtype for o in outs} == {torch.int32 if op == "int_mm" else BF16}


@pytest.mark.parametrize("op", OPS)
def test_fake_checks_the_arguments(op):
    """The fake refuses what the implementation refuses, with the same message."""
    args, error = list(_args(op)), TypeError
    if op == "int_mm":
        args[1] = args[1].float()
        expected = "`b` must have dtype"
    elif op == "route_experts":
        args[2], error = 24, ValueError
        expected = "fusepass.route_experts: `block_m` must be a power of two"
    else:
        out_dtype = next(i for i, a in enumerate(args) if a is BF16)
        args[out_dtype] = torch.int64
        expected = f"fusepass.{op}: `out_dtype` must be one of"
    with pytest.raises(error, match=expected):
        getattr(torch.ops.fusepass, op)(*args)
    mode = FakeTensorMode()
    with mode, pytest.raises(error, match=expected):
        getattr(torch.ops.fusepass, op)(*_fake(mode, args))


# (int_mm, route_experts: integers only, no gradient to ask for)
@pytest.mark.parametrize("op", [op for op in OPS if op not in ("int_mm", "route_experts")])
def test_no_gradient(op):
    """A call whose float input (a scale, or the float activation) needs a gradient raises at
    the forward."""
    args = list(_args(op))
    first = next(i for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype != E4M3)
    args[first] = args[first].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"fusepass.{op} has no gradient"):
        getattr(torch.ops.fusepass, op)(*args)


def test_a_wrapper_checks_its_list_members_too():
    """The group op's wrapper takes the dispatcher (and its autograd error) where a weight's scale,
    inside a list argument, needs a gradient; not the direct path, which has none."""
    args = list(_args("scaled_mm_group"))
    args[3] = [args[3][0].clone().requires_grad_(), args[3][1]]
    with pytest.raises(RuntimeError, match="fusepass.scaled_mm_group has no gradient"):
        fusepass.ops.scaled_mm_group(*args)
    args[3] = [s.detach() for s in args[3]]
    assert [o.shape for o in fusepass.ops.scaled_mm_group(*args)] == [(3, 128), (3, 128)]
