"""A second process compiling the same prepared model hits the caches (issue 36): the
AOTAutograd cache and Inductor's FX graph cache serve the graph (so the pass does not run
again), and ``counters["fusepass"]``, replayed from the cache entry, and the result are the
first process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchao")

PROBE = """
import json, os, sys, torch
from torch._dynamo.utils import counters
import fusepass
from fusepass.demo import models
from fusepass.integrations import linear
linear.SOURCE = os.environ.get("FUSEPASS_TEST_SOURCE", linear.SOURCE)  # (a stand-in for an edited linear.py)
bf16 = models.random_llama(models.Sizes(1, 128, 256, 4, 2, 256), 32, torch.device("cpu"), 0)
model = models.quantized_copy(bf16, "int8", "torchao")
fusepass.prepare(model)
with torch.no_grad():
    out = torch.compile(model, backend="fusepass", dynamic=False)(models.prompt(bf16, 2, 8, 0)).logits
print(json.dumps({"fusepass": dict(counters["fusepass"]), "aot": dict(counters["aot_autograd"]),
                  "inductor": dict(counters["inductor"]), "out": out.double().sum().item()}))
"""


def _compile_in_a_new_process(cache_dir, source: str | None = None) -> dict:
    env_code = f"import os; os.environ['TORCHINDUCTOR_CACHE_DIR'] = {str(cache_dir)!r}\n" + PROBE
    env = {k: v for k, v in os.environ.items() if k != "FUSEPASS_TEST_SOURCE"}
    env.update({"FUSEPASS_TEST_SOURCE": source} if source else {})
    done = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_prepared_model_compiles_from_the_caches_in_a_second_process(tmp_path):
    first = _compile_in_a_new_process(tmp_path)
    second = _compile_in_a_new_process(tmp_path)
    assert first["aot"].get("autograd_cache_miss") == 1 and first["inductor"].get("fxgraph_cache_miss") == 1
    assert second["aot"].get("autograd_cache_hit") == 1 and not second["aot"].get("autograd_cache_miss"), second["aot"]
    assert second["inductor"].get("fxgraph_cache_hit") == 1 and not second["inductor"].get("fxgraph_cache_miss")
    assert first["fusepass"] == second["fusepass"] == {"dequant_mm": 8, "joined_siblings": 2}, (first, second)
    assert first["out"] == second["out"]


def test_an_edited_prepared_linear_misses_the_caches(tmp_path):
    """A prepared linear traces as one node whose body the cache keys do not see: its sources'
    hash is an argument of the node (``linear.TRACED_FROM``: ``integrations/linear.py`` and the
    ops' recipes it traces; ``test_prepared_module.py`` holds the hash to those files), so an
    edited one misses them."""
    _compile_in_a_new_process(tmp_path)
    edited = _compile_in_a_new_process(tmp_path, source="edited")
    assert edited["aot"].get("autograd_cache_miss") == 1 and not edited["aot"].get("autograd_cache_hit"), edited["aot"]
