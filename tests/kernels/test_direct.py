"""Eager launches without Triton's per-call binding (``fusepass.kernels.direct``) and eager op
calls that repeat their first launch (``fusepass.ops.eager``): the same bits as Triton's
own launch, a new compile for every new set of specialization facts, split-K counters handed
back zeroed, and stream captures that keep their own counters."""

import pytest
import torch

import fusepass
from fusepass.kernels import direct, launch
from fusepass.kernels.configs import Config
from fusepass.ops import eager
from tests.support.blockwise_data import make_block_problem
from tests.support.helpers import make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args, stream: self.log.append(("compiled", grid, args, stream))


class _Kernel:
    """A stand-in for a @triton.jit kernel: ``kernel[grid](...)`` is Triton's own launch."""

    arg_names = ["x", "n", "y", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("triton", grid, args, meta))
            return _Compiled(self.log)
        return run


def test_direct_launcher_compiles_once_per_set_of_facts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    kernel = _Kernel()
    launcher = direct.DirectLauncher(kernel)
    x = torch.zeros(64, dtype=torch.int8)
    launcher[(4,)](x, 16, None, BLOCK=32, num_warps=4)
    launcher[(8, 2)](x.clone(), 16, None, BLOCK=32, num_warps=4)  # same facts, another tensor
    assert [e[0] for e in kernel.log] == ["triton", "compiled"]
    assert kernel.log[1][1:] == ((8, 2, 1), (kernel.log[1][2][0], 16, None, 32), 1234)  # constexprs appended
    for args, meta in [
        ((x[1:], 16, None), dict(BLOCK=32, num_warps=4)),  # a misaligned pointer
        ((x.float(), 16, None), dict(BLOCK=32, num_warps=4)),  # another dtype
        ((x, 17, None), dict(BLOCK=32, num_warps=4)),  # another int
        ((x, 16, x), dict(BLOCK=32, num_warps=4)),  # a tensor where None was
        ((x, 16, None), dict(BLOCK=64, num_warps=4)),  # another constexpr
        ((x, 16, None), dict(BLOCK=32, num_warps=8)),  # another launch option
    ]:
        kernel.log.clear()
        launcher[(4,)](*args, **meta)
        launcher[(4,)](*args, **meta)
        assert [e[0] for e in kernel.log] == ["triton", "compiled"], (args, meta)


def test_direct_launcher_keeps_nothing_when_a_parameter_takes_its_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = _Kernel()
    launcher = direct.DirectLauncher(kernel)
    for _ in range(2):
        assert launcher[(1,)](torch.zeros(4), 1, None) is None  # BLOCK left to its default
    assert [e[0] for e in kernel.log] == ["triton", "triton"]


def test_launcher_by_mode():
    kernel = _Kernel()
    assert isinstance(direct.launcher(kernel, fake=False), direct.DirectLauncher)
    assert direct.launcher(kernel, fake=False) is direct.launcher(kernel, fake=False)


def test_replay_repeats_a_launch_with_the_calls_own_tensors(monkeypatch):
    launched = []
    monkeypatch.setattr(direct, "launch_compiled", lambda entry, grid, args, device: launched.append((entry, grid, args)))
    monkeypatch.setattr(direct, "split_scratch", lambda *spec: (("partial", spec), ("tickets", spec)))
    a, b, out = torch.ones(2, 3), torch.ones(3, 4), torch.empty(4, 2).t()
    args = (a, b, out, None, torch.empty(24, dtype=torch.int32), torch.zeros(9), 7, True)
    spec = (3, 9, 2, 4, torch.int32)  # split_k, tiles, M, N, the partial slices' dtype
    with direct.recording((a, b)) as launches:
        direct.record("entry", (9, 3), args, out, (args[4], args[5]))  # grid (tiles, split_k)
    (replay, recorded_out), = launches
    assert recorded_out is out
    a2, b2 = a + 1, b + 1
    new = replay((a2, b2))
    (entry, grid, got), = launched
    assert (entry, grid) == ("entry", (9, 3, 1))
    assert got[0] is a2 and got[1] is b2 and got[2] is new and got[3] is None
    assert got[4] == ("partial", (*spec, a2.device)) and got[5] == ("tickets", (*spec, a2.device))
    assert tuple(got[6:]) == (7, True)
    assert new.shape == out.shape and new.stride() == out.stride() and new is not out


def test_record_keeps_no_replay_of_a_copied_input():
    a, out = torch.ones(2, 3), torch.empty(2)
    with direct.recording((a,)) as launches:
        direct.record("entry", (1,), (a.clone(), out), out, None)  # a contiguous copy of `a`
        direct.record(None, (1,), (a, out), out, None)  # a launch Triton did not hand back
    assert launches == [(None, out), (None, out)]
    direct.record("entry", (1,), (a, out), out, None)  # outside a recording: nothing kept


def test_split_k_hands_its_counters_back_zeroed(monkeypatch):
    """One counter buffer across launches (as eager launches on one stream share it): each
    launch must find it zeroed, so each launch's last programs must zero it again."""
    tickets = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(launch, "split_scratch", lambda split_k, tiles, M, N, dtype, device: (
        torch.empty(split_k * M * N, dtype=dtype, device=device), tickets))
    for seed, (M, N, K) in enumerate([(5, 33, 96), (16, 64, 128), (1, 100, 200)]):
        p = make_problem(M, N, K, device=DEVICE, seed=seed)
        unsplit = launch.launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, config=Config(16, 32, 32))
        split = launch.launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32,
                                        config=Config(16, 32, 32, split_k=3))
        assert torch.equal(split, unsplit)  # int8: the same int32 sums
        assert not tickets.any()


def test_split_scratch_off_the_gpu_is_made_afresh():
    partial, tickets = direct.split_scratch(3, 5, 2, 4, torch.float32, torch.device("cpu"))
    assert partial.shape == (24,) and partial.dtype == torch.float32
    assert tickets.shape == (5,) and tickets.dtype == torch.int32 and not tickets.any()
    assert direct.split_scratch(3, 5, 2, 4, torch.float32, torch.device("cpu"))[0] is not partial


def _tickets_zero() -> bool:
    torch.cuda.synchronize()
    return all(not kept["tickets"].any() for kept in direct._SCRATCH.values())


# --- on the GPU --------------------------------------------------------------------------


def _calls():
    """Eager op calls, each with the arguments Triton specializes on changed somewhere."""
    calls = []
    for M, N, K in [(1, 4096, 4096), (16, 4096, 4096), (17, 1000, 1001), (64, 512, 256)]:
        p = make_problem(M, N, K, device="cuda", bias_dtype=torch.bfloat16, seed=M)
        calls.append(("scaled_mm", (p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.bias)))
    p = make_problem(16, 256, 256, torch.float8_e4m3fn, device="cuda", sa_shape=(), sb_shape=(1, 256))
    calls.append(("scaled_mm", (p.a, p.b, p.scale_a.bfloat16(), p.scale_b, torch.float16, None)))
    p = make_problem(16, 256, 257, device="cuda")
    wide = torch.zeros(16, 258, dtype=torch.int8, device="cuda")
    wide[:, 1:].copy_(p.a)
    calls.append(("scaled_mm", (wide[:, 1:], p.b, p.scale_a, p.scale_b, torch.float32, None)))  # misaligned a
    p = make_problem(8, 512, 512, device="cuda", azp="token", bias_dtype=torch.float32)
    calls.append(("scaled_mm_azp", (p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.azp_adj, p.azp, p.bias)))
    calls.append(("int_mm", (p.a, p.b)))
    blk = make_block_problem(16, 576, 7168, device="cuda")
    calls.append(("scaled_mm_blockwise", (blk.a, blk.b, blk.scale_a, blk.scale_b, torch.bfloat16, None)))
    return calls


def _same_facts(t, seed: int):
    """Another tensor with ``t``'s dtype, shape, strides, storage offset (so alignment) and
    device, and other values."""
    if not isinstance(t, torch.Tensor):
        return t
    g = torch.Generator().manual_seed(seed)
    n = t.untyped_storage().nbytes() // t.element_size()
    if t.dtype == torch.int8:
        base = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
    elif t.dtype == torch.int32:
        base = torch.randint(-100, 100, (n,), generator=g, dtype=torch.int32)
    elif t.dtype == torch.float8_e4m3fn:
        base = torch.randn(n, generator=g).to(t.dtype)
    else:
        base = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(t.dtype)
    return base.to(t.device).as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.gpu
def test_eager_calls_repeat_their_first_launch_bit_for_bit(monkeypatch):
    repeats = []
    replay = direct.Replay.__call__
    monkeypatch.setattr(direct.Replay, "__call__", lambda self, inputs: repeats.append(1) or replay(self, inputs))
    for name, args in _calls():
        op, wrapper = getattr(torch.ops.fusepass, name), getattr(fusepass, name)
        assert torch.equal(wrapper(*args), op(*args)), name  # the first call: the implementation
        for seed in range(2):  # the same facts, other tensors: repeats, with their own tensors
            other = tuple(_same_facts(v, seed) for v in args)
            assert torch.equal(wrapper(*other), op(*other)), name  # (op: the dispatcher's path, no repeat)
        assert len(repeats) == 2, name
        repeats.clear()
    assert _tickets_zero()


@pytest.mark.gpu
def test_eager_call_that_passes_one_tensor_twice():
    p = make_problem(8, 64, 64, device="cuda", sa_shape=(), sb_shape=())
    s = torch.full((), 0.5, device="cuda")
    plans = len(eager._PLANS)
    twice = fusepass.scaled_mm(p.a, p.b, s, s, torch.float32)
    assert torch.equal(twice, torch.ops.fusepass.scaled_mm(p.a, p.b, s, s, torch.float32))
    assert len(eager._PLANS) == plans  # not recorded: which argument went where is ambiguous
    for _ in range(2):  # recorded from distinct tensors, then repeated for both kinds of call
        assert torch.equal(fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32),
                           torch.ops.fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32))
        assert torch.equal(fusepass.scaled_mm(p.a, p.b, s, s, torch.float32), twice)
    x = p.a[:, :8].contiguous()  # square: int_mm(x, x)
    assert torch.equal(fusepass.int_mm(x, x), torch.ops.fusepass.int_mm(x, x))
    y = _same_facts(x, 1)
    assert torch.equal(fusepass.int_mm(x, y), torch.ops.fusepass.int_mm(x, y))


@pytest.mark.gpu
def test_eager_split_k_hands_its_counters_back_zeroed():
    for M, N, K in [(1, 100, 1000), (16, 4096, 512), (5, 33, 96)]:
        p = make_problem(M, N, K, device="cuda", seed=M)
        unsplit = launch.launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, config=Config(16, 32, 32))
        for _ in range(3):
            split = launch.launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32,
                                            config=Config(16, 32, 32, split_k=3))
            assert torch.equal(split, unsplit)  # int8: the same int32 sums
    assert direct._SCRATCH and _tickets_zero()


def _split_row():
    """A problem whose eager op call splits K: M = 1 of a tuned split row, its weight stored
    (K, N) (a w.t() would take the unsplit M = 1 kernel, gemv.py)."""
    p = make_problem(1, 4096, 14336, device="cuda", bias_dtype=torch.bfloat16)
    p.b = p.b.contiguous()
    assert launch.select_config(1, 4096, 14336, torch.int8, p.a.device).split_k > 1
    assert not launch.gemv_allowed(p.a, p.b)
    return p


@pytest.mark.gpu
def test_eager_split_k_in_a_stream_capture_keeps_its_own_counters():
    p = _split_row()
    args = (p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.bias)
    fusepass.scaled_mm(*args)  # compiles, and leaves a repeatable launch
    before = {k: {n: t.data_ptr() for n, t in kept.items()} for k, kept in direct._SCRATCH.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fusepass.scaled_mm(*args)
    assert {k: {n: t.data_ptr() for n, t in kept.items()} for k, kept in direct._SCRATCH.items()} == before
    for seed in range(3):
        p.a.copy_(make_problem(1, 4096, 14336, device="cuda", seed=seed + 1).a)
        graph.replay()
        assert torch.equal(out, fusepass.scaled_mm(*args))
    assert _tickets_zero()


@pytest.mark.gpu
def test_eager_calls_on_a_side_stream():
    p = _split_row()
    args = (p.a, p.b, p.scale_a, p.scale_b, torch.bfloat16, p.bias)
    want = fusepass.scaled_mm(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [fusepass.scaled_mm(*args) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(o, want) for o in outs)
    assert (p.a.device.index, side.cuda_stream) in direct._SCRATCH


@pytest.mark.gpu
def test_eager_call_that_fails_its_checks_fails_every_time():
    p = make_problem(4, 64, 64, device="cuda")
    for _ in range(2):
        with pytest.raises(ValueError, match="`scale_b` must hold one value"):
            fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b[:, :8], torch.bfloat16)
    with pytest.raises(TypeError, match="`out_dtype` must be one of"):
        fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, ["bfloat16"])


@pytest.mark.gpu
def test_eager_call_with_a_copied_input_is_not_repeated():
    p = make_problem(4, 64, 64, device="cuda")
    strided = torch.zeros(64, 2, device="cuda")[:, 0]  # [N], stride 2: copied before the launch
    strided.copy_(p.scale_b.reshape(-1))
    want = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32)
    size = len(eager._PLANS)
    for _ in range(2):
        assert torch.equal(fusepass.scaled_mm(p.a, p.b, p.scale_a, strided, torch.float32), want)
    assert len(eager._PLANS) == size


def test_call_replay_repeats_a_recorded_call_with_new_tensors():
    """A non-Triton call (cuBLAS's GEMM) of the op's own tensors is recorded and repeated with
    a later call's; one of a tensor made for the call (a copy) is not."""
    x, y = torch.ones(3), torch.full((3,), 2.0)
    fn = lambda t, u, k: t * u + k  # noqa: E731
    with direct.recording((x, y)) as launches:
        out = fn(x, y, 1.0)
        direct.record_call(fn, (x, y, 1.0), out)
        copy = x.clone()
        direct.record_call(fn, (copy, y, 1.0), out)
    (replay, recorded), (none, _) = launches
    assert recorded is out and none is None
    assert torch.equal(replay((torch.full((3,), 3.0), torch.full((3,), 4.0))), torch.full((3,), 13.0))
    assert not any(isinstance(v, torch.Tensor) for v in replay.template)  # keeps no tensor
    direct.record_call(fn, (x, y, 1.0), out)  # outside a recording: nothing to do
