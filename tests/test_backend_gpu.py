"""End to end on a GPU: a small W8A8 model compiled with backend="fusepass"."""

import copy
import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from tests.support.models import MLP

pytestmark = pytest.mark.gpu

CASES = {torch.int8: "int_mm_scaled", torch.float8_e4m3fn: "scaled_mm_fp8_epilogue"}


def _x(tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens // 2, 64, generator=g).to("cuda", torch.bfloat16)


def _check(out, eager, exact):
    """The numerics policy, model-level: the fused model is no further from the float
    model than eager (2% slack: eager rounds in bf16 in between, and re-quantizing the
    hidden activations turns a last-bit difference into a whole int8/fp8 step)."""
    assert out.shape == eager.shape and out.dtype == eager.dtype
    err = lambda y: ((y.double() - exact.double()).norm() / exact.double().norm()).item()  # noqa: E731
    assert err(out) <= 1.02 * err(eager), (err(out), err(eager))
    assert ((out.double() - eager.double()).norm() / eager.double().norm()).item() < 0.05


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    counters["fusepass"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("dtype", list(CASES), ids=["int8", "fp8"])
def test_every_linear_fused_and_matches_eager(dtype):
    model, exact = MLP(dtype=dtype).cuda().eval(), MLP(dtype=None).cuda().eval()
    x = _x(64 if dtype == torch.int8 else 16)  # fp8 fuses at M <= PassConfig.fp8_max_m
    with torch.no_grad():
        out = torch.compile(model, backend="fusepass")(x)
        _check(out, model(x), exact(x.double()))
    assert counters["fusepass"] == {CASES[dtype]: 2}


@pytest.mark.parametrize("dtype", list(CASES), ids=["int8", "fp8"])
def test_dynamic_m_without_recompiles(dtype):
    model, exact = MLP(dtype=dtype).cuda().eval(), MLP(dtype=None).cuda().eval()
    compiled = torch.compile(model, backend="fusepass", dynamic=True)
    with torch.no_grad():
        _check(compiled(_x(64)), model(_x(64)), exact(_x(64).double()))
        with torch.compiler.set_stance("fail_on_recompile"):
            for tokens in (32, 160, 4096):
                x = _x(tokens, seed=tokens)
                _check(compiled(x), model(x), exact(x.double()))
    # A symbolic M may be above PassConfig.fp8_max_m: fp8 stays on cuBLAS at every M.
    assert counters["fusepass"] == ({CASES[dtype]: 2} if dtype == torch.int8 else {})


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_inductor_launches_the_kernels_itself(dynamic):
    """No fusepass op call (Python dispatch) is left in the compiled code: Inductor's own
    wrapper launches scaled_mm_kernel. With a symbolic M it branches on M's bucket."""
    model = MLP().cuda().eval()
    with torch.no_grad():
        _, (code, *_) = run_and_get_code(torch.compile(model, backend="fusepass", dynamic=dynamic), _x(64))
    assert "torch.ops.fusepass" not in code and "_int_mm" not in code
    assert "scaled_mm_kernel" in code
    if dynamic:  # one kernel per distinct bucket config, chosen by a host-side if on M
        assert code.count("BLOCK_M : tl.constexpr") >= 2 or code.count("def scaled_mm_kernel") >= 2, code
        assert " <= 16" in code or " <= 64" in code, code


def test_no_copies_of_the_kernel_arguments():
    """One int8 buffer per quantized activation. Unused pointers once took the activation
    as a placeholder, and Inductor wrote one more copy of it for each (run 5 of NOTES)."""
    model = MLP().cuda().eval()
    with torch.no_grad():
        _, (code, *_) = run_and_get_code(torch.compile(model, backend="fusepass"), _x(64))
    int8_buffers = [line for line in code.splitlines() if "empty_strided_cuda(" in line and "torch.int8" in line]
    assert 1 <= len(int8_buffers) <= 2, int8_buffers  # (Inductor may reuse one for the other)


def test_reduce_overhead_cuda_graphs():
    model, exact = MLP().cuda().eval(), MLP(dtype=None).cuda().eval()
    compiled = torch.compile(model, backend="fusepass", mode="reduce-overhead")
    with torch.no_grad():
        for step in range(3):  # warm-up, record, replay
            x = _x(64, seed=step)
            _check(compiled(x).clone(), model(x), exact(x.double()))
    assert counters["fusepass"] == {"int_mm_scaled": 2}


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("dtype", list(CASES), ids=["int8", "fp8"])
def test_frozen_weights_fuse_and_are_held(dtype, mode):
    """Under Inductor's freezing (set while Dynamo traces) the weights are constants of the
    compiled code, and every linear still fuses: the rewrite runs before freezing folds."""
    inputs = []
    model, exact = MLP(dtype=dtype).cuda().eval(), MLP(dtype=None).cuda().eval()
    with torch.no_grad(), torch._inductor.config.patch(
            freezing=True, post_grad_custom_pre_pass=lambda g: inputs.append(len(g.find_nodes(op="placeholder")))):
        compiled = torch.compile(model, backend="fusepass", mode=mode)
        for step in range(3):  # (CUDA graphs: warm-up, record, replay)
            x = _x(64 if dtype == torch.int8 else 16, seed=step)  # (eager's _int_mm: M > 16)
            _check(compiled(x).clone(), model(x), exact(x.double()))
    assert counters["fusepass"] == {CASES[dtype]: 2}
    assert inputs == [1]  # x alone


def test_decode_splits_k_only_in_cuda_graphs():
    """A decode launch splits K (one more buffer, int32 tile counters, and Inductor's fill of
    them) inside CUDA graphs only: outside, the fill is a launch a host-bound step pays for
    (benchmarks/NOTES.md, run 9). Both projections split at M = 2 in the sm90 table (M = 1 runs
    the unsplit kernel of gemv.py)."""
    import fusepass
    from fusepass.passes import PassConfig

    model, exact = MLP(4096, 1024, torch.float8_e4m3fn).cuda().eval(), MLP(4096, 1024, None).cuda().eval()
    x = torch.randn(1, 2, 4096, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)

    def counter_buffers(**compile_kwargs):
        torch._dynamo.reset()
        with torch.no_grad():
            out, (code, *_) = run_and_get_code(torch.compile(model, **compile_kwargs), x)
            _check(out.clone(), model(x), exact(x.double()))
        return [line for line in code.splitlines() if "empty_strided_cuda(" in line and "torch.int32" in line]

    assert counter_buffers(backend="fusepass") == []
    # (Inductor may reuse one projection's counters for the other)
    assert counter_buffers(backend="fusepass", mode="reduce-overhead")
    # a caller that captures the compiled code itself asks for the split
    outside = fusepass.inductor_options(config=PassConfig(split_k_outside_cuda_graphs=True))
    assert counter_buffers(options=outside)
    assert counters["fusepass"] == {"scaled_mm_fp8_epilogue": 6}


def test_decode_row_reductions_take_one_launch():
    """A per-row int8 quantization of a 14336-wide activation at M = 1 (a W8A8 down_proj's
    input) is one kernel under the backend, where stock Inductor on sm90 splits its amax into
    three launches (fusepass/choices.py); the same values either way (max is exact)."""
    import fusepass

    x = torch.randn(1, 14336, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)

    def quantize(x):
        scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-5) / 127
        return (x / scale).round().clamp(-128, 127).to(torch.int8)

    def launches(**compile_kwargs):
        torch._dynamo.reset()
        out, (code, *_) = run_and_get_code(torch.compile(quantize, **compile_kwargs), x)
        return out, code.count(".run(")

    (ours, n), (stock, n_stock) = launches(backend="fusepass"), launches(options=fusepass.inductor_options())
    assert torch.equal(ours, stock) and torch.equal(ours, quantize(x))
    if n_stock == 1:
        pytest.skip("this torch's Inductor does not split the reduction here")
    assert n == 1, (n, n_stock)


def test_torchao_int8_dynamic_on_gpu():
    torchao = pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    import fusepass

    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).cuda().bfloat16().eval()
    exact = copy.deepcopy(m).double()
    quantize_(m, Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(4, 32, 256, device="cuda", dtype=torch.bfloat16)
    report = fusepass.explain(m, x)
    assert len(report.decisions) == 2 and all(d.fused for d in report.decisions), str(report)
    with torch.no_grad():
        _check(torch.compile(m, backend="fusepass")(x), m(x), exact(x.double()))
    print(torchao.__version__, report)


def test_rowwise_scaled_mm_at_decode_size():
    """scaled_mm_fp8_direct on the GPU: row-wise fp8 _scaled_mm with bias, M <= 16, becomes ours."""

    def f(a, b, sa, sb, bias):
        return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8, 4096, device="cuda", generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(1024, 4096, device="cuda", generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(8, 1, device="cuda") / 64, torch.rand(1, 1024, device="cuda") / 64
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    out = torch.compile(f, backend="fusepass")(a, w.t(), sa, sb, bias)
    assert counters["fusepass"] == {"scaled_mm_fp8_direct": 1}
    exact = (a.double() @ w.double().t()) * sa.double() * sb.double() + bias.double()
    eager = f(a, w.t(), sa, sb, bias)
    _check(out, eager, exact)


class _QKV(torch.nn.Module):
    """Three sibling quantized linears of one input (attention's q, k and v)."""

    def __init__(self, dtype, dim=4096, kv=1024, bias=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = lambda n: torch.randn(n, dim, generator=g) / dim**0.5  # noqa: E731
        b = lambda n: torch.randn(n, generator=g) if bias else None  # noqa: E731
        from tests.support.models import W8A8Linear

        self.q, self.k, self.v = (W8A8Linear(w(n), b(n), dtype) for n in (dim, kv, kv))

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


@pytest.mark.parametrize("dtype", list(CASES), ids=["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 16])
def test_sibling_linears_take_one_launch(dtype, bias, rows):
    """q/k/v at M = 1, and at M = 16 where decode launches split K (as inside CUDA graphs: the
    group takes the joined 3072 x 2048 weight's split, 2 on 132 SMs): one grouped kernel launch
    instead of three, the same values as the ungrouped compile (int8: bit for bit, exact int32
    sums; fp8: another BLOCK_K may sum in another order), close to the float linears."""
    import fusepass
    from fusepass.kernels.group_launch import group_config
    from fusepass.passes import PassConfig

    dim, kv, split = (4096, 1024, {}) if rows == 1 else (2048, 512, dict(split_k_outside_cuda_graphs=True))
    model = _QKV(dtype, dim, kv, bias=bias).cuda().eval()
    x = torch.randn(1, rows, dim, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)

    def compiled(config):
        torch._dynamo.reset()
        options = fusepass.inductor_options(config=config)
        with torch.no_grad():
            out, (code, *_) = run_and_get_code(torch.compile(model, backend="fusepass", options=options), x)
        return out, code

    grouped, code = compiled(PassConfig(**split))
    ungrouped, code_ungrouped = compiled(PassConfig(group_max_m=0, **split))
    launches = lambda name, code: len(re.findall(rf"\b{name}\w*\.run\(", code))  # noqa: E731
    assert launches("scaled_mm_group_kernel", code) == 1 and launches("scaled_mm_kernel", code) == 0, code
    if rows == 1:  # q (N = 4096) on gemv.py's kernel, k and v (N = 1024, too narrow for it) on the tiles
        assert launches("scaled_gemv_kernel", code_ungrouped) == 1 and launches("scaled_mm_kernel", code_ungrouped) == 2
    else:  # the group's (split, M, sum N_i) partial slices
        split_k = group_config(rows, [dim, kv, kv], dim, dtype, x.device, k_contiguous=True).split_k
        assert split_k > 1 and launches("scaled_mm_kernel", code_ungrouped) == 3, split_k
        assert f"({split_k}, {rows}, {dim + 2 * kv})" in code, code
    rel = lambda y, ref: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    for g, u, lin in zip(grouped, ungrouped, (model.q, model.k, model.v)):
        # (eager int8 cannot run: torch._int_mm needs M > 16 on CUDA) the float linear the
        # quantized one approximates
        w = lin.wq.double() * lin.ws.double().t()
        exact = x.double().reshape(rows, -1) @ w.t() + (0 if lin.bias is None else lin.bias.double())
        if dtype == torch.int8:
            assert torch.equal(g, u)
        assert rel(g.reshape(rows, -1), u.reshape(rows, -1).double()) < 1e-2 and rel(g.reshape(rows, -1), exact) < 0.05
