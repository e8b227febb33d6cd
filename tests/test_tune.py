"""benchmarks/tune.py's table bookkeeping (the tuning itself needs a GPU): an updated table
keeps the commands that wrote it and its notes."""

import json

import pytest
import torch

from tests.bench_scripts import load


@pytest.fixture(scope="module")
def tune():
    return load("tune")


def test_save_appends_the_command_and_keeps_notes(tune, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(tune, "device_arch", lambda d: "sm90")
    out = tmp_path / "sm90.json"
    table = {"defaults": {}, "shapes": {}, "meta": {"command": "python benchmarks/tune.py", "notes": "kept"}}
    tune.save(table, str(out), ["--shapes", "8b-hf"])
    tune.save(table, str(out), ["--shapes", "8b-hf"])  # the same command again: listed once
    meta = json.loads(out.read_text())["meta"]
    assert meta["commands"] == ["python benchmarks/tune.py", "python benchmarks/tune.py --shapes 8b-hf"]
    assert meta["notes"] == "kept" and "command" not in meta and meta["gpu"] == "NVIDIA H200"
