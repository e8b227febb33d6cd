"""A fixed-seed subset of the differential fuzzer (``python -m tools.fuzz`` runs more)."""

import pytest
import torch

from tools.fuzz import _draw, _draw_blockwise, check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_pass(seed):
    p = _draw(seed, DEVICE)
    assert check(p, "capture") is None, " ".join(p.desc)


@pytest.mark.parametrize("seed", [3, 7, 11])  # int8, fp8 _scaled_mm and dequant programs, through Inductor
def test_fuzz_backend(seed):
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        p = _draw(seed, DEVICE)
        assert check(p, "fusepass") is None, " ".join(p.desc)


# Block-wise fp8 forms: every spread of the scales, groups of 64 and a shared dequantized
# weight (must not fuse), a shared mid-chain value (in part), 3-D activations, bias, tails.
@pytest.mark.parametrize("seed", [1, 2, 3, 6, 14, 16, 22, 28])
def test_fuzz_blockwise(seed):
    p = _draw_blockwise(seed, DEVICE)
    assert check(p, "capture") is None, " ".join(p.desc)
