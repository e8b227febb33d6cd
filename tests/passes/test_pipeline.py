"""The pass as an ordered list of named steps (``fuse_pass.PIPELINE``), each enabled by its
config; counters and the cache key follow the steps."""

import torch.fx as fx
from torch._dynamo.utils import counters

from fusepass.passes import FusePass, PassConfig, fuse_pass
from fusepass.passes.fuse_pass import PIPELINE

ALL_OFF = PassConfig(patterns=(), join_siblings=False, group_max_m=0, quantize_in_gemv=False,
                     quantize_groups_in_gemv=False, share_activations=False)


def test_the_steps_in_order():
    assert [s.name for s in PIPELINE] == [
        "expanded", "patterns", "joined_siblings", "scaled_mm_group", "dead_code", "quantized_in_gemv",
        "quantized_groups_in_gemv", "shared_activation", "dead_code", "lint"]
    assert [s.name for s in PIPELINE if not s.tidy and s.enabled(PassConfig())] == [
        "expanded", "patterns", "joined_siblings", "scaled_mm_group", "quantized_in_gemv", "quantized_groups_in_gemv",
        "shared_activation"]  # (quantized_in_gemv: None, and no CUDA graphs here)
    assert [s.name for s in PIPELINE if not s.tidy and s.enabled(ALL_OFF)] == []


def _recording(monkeypatch, done: dict) -> list:
    """Each step's function replaced by one that records its call and returns ``done[name]``."""
    ran = []
    for name, attr in (("joined_siblings", "join_siblings"), ("scaled_mm_group", "group_siblings"),
                       ("quantized_in_gemv", "quantize_in_gemv"), ("quantized_groups_in_gemv", "quantize_groups_in_gemv"),
                       ("shared_activation", "share_activations")):
        monkeypatch.setattr(fuse_pass, attr, lambda *a, name=name: ran.append(name) or done.get(name, []))
    monkeypatch.setattr(fx.Graph, "eliminate_dead_code", lambda self: ran.append("dead_code"))
    monkeypatch.setattr(fx.Graph, "lint", lambda self: ran.append("lint"))
    return ran


def test_a_step_runs_where_its_config_enables_it(monkeypatch):
    ran = _recording(monkeypatch, {})
    FusePass(ALL_OFF).run(fx.Graph())
    assert ran == []  # (nothing changed: no tidy step either)
    FusePass(PassConfig(quantize_in_gemv=True)).run(fx.Graph())
    assert ran == ["joined_siblings", "scaled_mm_group", "quantized_in_gemv", "quantized_groups_in_gemv",
                   "shared_activation"]


def test_what_a_step_changes_is_counted_and_tidied(monkeypatch):
    ran = _recording(monkeypatch, {"joined_siblings": [["q", "k", "v"]], "shared_activation": ["o"]})
    counters["fusepass"].clear()
    FusePass(PassConfig(quantize_in_gemv=False)).run(fx.Graph())
    assert ran == ["joined_siblings", "scaled_mm_group", "dead_code", "quantized_groups_in_gemv",
                   "shared_activation", "dead_code", "lint"]
    assert dict(counters["fusepass"]) == {"joined_siblings": 1, "shared_activation": 1}


def test_the_cache_key_names_the_steps_in_force():
    assert FusePass(PassConfig()).uuid() != FusePass(PassConfig(share_activations=False)).uuid()
    assert FusePass(PassConfig()).uuid() == FusePass(PassConfig()).uuid()
    assert PIPELINE[2].uuid(PassConfig()) == "joined_siblings:on"
    assert PIPELINE[2].uuid(ALL_OFF) == "joined_siblings:off"
