"""Fixtures of the kernel tests."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusepass.kernels import configs, launch


@pytest.fixture
def sm90(monkeypatch):
    """Fake CUDA tensors (no GPU needed) on a pretend sm90 GPU with a CUDA 13.0 torch: where
    the ops run cuBLAS's torch._scaled_mm instead of their kernels (the GPU tests run both)."""
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with FakeTensorMode():
        yield


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """``configs`` reading its tuned tables from ``tmp_path`` (caches cleared around the test)."""
    monkeypatch.setattr(configs, "TABLE_DIR", tmp_path)
    configs.load_table.cache_clear()
    configs._config.cache_clear()
    yield tmp_path
    configs.load_table.cache_clear()
    configs._config.cache_clear()
