import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
# this when a kernel is decorated, so it must be set before fusepass is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

import fusepass  # noqa: E402,F401  registers torch.ops.fusepass.* (after TRITON_INTERPRET)
