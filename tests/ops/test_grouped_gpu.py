"""fusepass.scaled_grouped_mm on CUDA: the experts of Qwen3-30B-A3B and OLMoE-1B-7B at decode,
batch 16 and prefill row counts against the float64 oracle (both kernels, experts with no rows),
CUDA graphs with new routing replayed, and a converted experts module compiled into CUDA graphs."""

import pytest
import torch

import fusepass
from fusepass.integrations.experts import W8A8Experts, quantize_experts
from fusepass.kernels.policy import GROUPED_ROWS_MAX_M
from tests.ops.test_grouped import assert_matches_oracle
from tests.support.grouped_data import Grouped

pytestmark = pytest.mark.gpu
# (E, K, N): Qwen3-30B-A3B's gate/up and down, OLMoE-1B-7B's down
EXPERTS = [(128, 2048, 1536), (128, 768, 2048), (64, 1024, 2048)]
_WEIGHTS: dict = {}


def _weights(E, K, N, dtype):
    """The experts' [E, N, K] weights (as transformers stores them), made once per shape on the GPU."""
    key = (E, K, N, dtype)
    if key not in _WEIGHTS:
        g = torch.Generator(device="cuda").manual_seed(E + K + N)
        w = torch.randint(-128, 128, (E, N, K), dtype=torch.int8, device="cuda", generator=g)
        if dtype != torch.int8:
            w = (torch.randn((E, N, K), device="cuda", generator=g) * 2).to(dtype)
        _WEIGHTS.clear()
        _WEIGHTS[key] = w
    return _WEIGHTS[key]


def routed_problem(tokens, top_k, E, K, N, dtype, seed=0, blocks=False) -> Grouped:
    """``blocks``: fp8 with one scale per 1x128 group and per 128x128 block (native FP8's experts)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    M = tokens * top_k
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda", generator=g)
    if dtype != torch.int8:
        a = (torch.randn((M, K), device="cuda", generator=g) * 2).to(dtype)
    ids = torch.rand((tokens, E), device="cuda", generator=g).argsort(dim=1)[:, :top_k].reshape(-1)
    groups, n_blocks = -(-K // 128), -(-N // 128)
    sa_shape, sb_shape = ((M, groups), (E, n_blocks, groups)) if blocks else ((M,), (E, N))
    sb = torch.rand(sb_shape, device="cuda", generator=g) * 0.02 + 0.001
    return Grouped(a, _weights(E, K, N, dtype).transpose(1, 2),
                   torch.rand(sa_shape, device="cuda", generator=g) * 0.02 + 0.001,
                   sb.transpose(1, 2) if blocks else sb, ids, row_weights=torch.rand(M, device="cuda", generator=g))


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("E,K,N", EXPERTS)
@pytest.mark.parametrize("tokens", [1, 4, 16, 128, 2048])  # M = 8 (decode) ... 16384 (prefill 2048)
def test_gpu_experts_shapes_against_the_oracle(tokens, E, K, N, kind):
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    p = routed_problem(tokens, 8, E, K, N, dtype, seed=tokens, blocks=kind == "fp8-block")
    if tokens * 8 < E:
        assert p.expert_ids.unique().numel() < E  # (experts with no rows)
    out = fusepass.scaled_grouped_mm(*p.args())
    assert out.is_cuda and out.shape == (tokens * 8, N)
    assert_matches_oracle(out, p, torch.bfloat16)


@pytest.mark.parametrize("M", [8, GROUPED_ROWS_MAX_M + 1, 256])
def test_gpu_cuda_graph_replays_new_routing(M):
    p = routed_problem(M // 8 or 1, 8, 128, 768, 2048, torch.int8, seed=M)
    eager = fusepass.scaled_grouped_mm(*p.args())  # (compiles the kernel outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fusepass.scaled_grouped_mm(*p.args())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q = routed_problem(M // 8 or 1, 8, 128, 768, 2048, torch.int8, seed=M + 1)
    for name in ("a", "scale_a", "expert_ids", "row_weights"):  # new rows and routing into the captured buffers
        getattr(p, name).copy_(getattr(q, name))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_oracle(out, p, torch.bfloat16)
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 16])  # (16 x top-4: the sorted blocks, after the rows' quantization kernel)
def test_gpu_experts_module_compiled_into_cuda_graphs(tokens, kind):
    from tests.integrations.test_experts import _routed_inputs, moe_model

    model = moe_model("qwen3_moe").cuda()
    quantize_experts(model, kind)
    module = next(m for m in model.modules() if isinstance(m, W8A8Experts))
    inputs = _routed_inputs(tokens, 128, 16, 4, seed=tokens, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="fusepass", mode="reduce-overhead", dynamic=False, fullgraph=True)
    with torch.no_grad():
        want = module(*inputs)
        for _ in range(3):  # (warm-up, record, replay)
            got = compiled(*inputs).clone()
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 1e-2
