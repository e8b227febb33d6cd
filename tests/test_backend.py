"""The torch.compile entry points: the named backend, inductor_options, the FX graph cache.

These run Inductor for real (C++ codegen on CPU, ~20 s a compile), so they are few.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import fusepass
from fusepass.backend import ChainedPass, capture_backend
from fusepass.passes import RewritePass
from tests.support.models import MLP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _x(M=24):
    return torch.randn(2, M // 2, 64, generator=torch.Generator().manual_seed(1))


class UserPass(CustomGraphPass):
    """A user's own graph pass: records that it ran, and what it saw (an int_mm; the inputs)."""

    def __init__(self):
        self.saw_int_mm, self.inputs = [], []

    def __call__(self, graph):
        self.saw_int_mm.append(any(n.target is torch.ops.aten._int_mm.default for n in graph.nodes))
        self.inputs.append(len(graph.find_nodes(op="placeholder")))

    def uuid(self):
        return "user-pass-v1"


@pytest.fixture
def fresh_compile():
    """Compile for real: no graph served from an earlier run's caches."""
    torch._dynamo.reset()
    counters["fusepass"].clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _reference(model, x):
    with torch.no_grad():
        return model(x)


def test_backend_by_name_fuses_every_linear(fresh_compile):
    model, x = MLP().eval(), _x()
    with torch.no_grad():
        out = torch.compile(model, backend="fusepass")(x)
    assert counters["fusepass"] == {"int_mm_scaled": 2}
    torch.testing.assert_close(out, _reference(model, x), rtol=1e-5, atol=1e-5)


def test_backend_fuses_under_inductor_freezing(fresh_compile):
    """Frozen weights are constants, and Inductor folds what is computed from them alone before
    its post-grad passes (a dequantized weight became a float constant; on this CPU oneDNN's
    int8 linears took both matmuls). Under freezing the rewrite runs in the joint graph, before
    that (``RewritePass``): both linears fuse, the user's joint pass first still sees the
    int_mm, and the compiled graph takes the input alone (weights and scales held)."""
    joint, post = UserPass(), UserPass()
    model, x = MLP().eval(), _x()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True, joint_custom_post_pass=joint,
                                                       post_grad_custom_pre_pass=post):
        out = torch.compile(model, backend="fusepass")(x)
    assert counters["fusepass"] == {"int_mm_scaled": 2}
    assert (joint.saw_int_mm, post.saw_int_mm, post.inputs) == ([True], [False], [1])
    torch.testing.assert_close(out, _reference(model, x), rtol=1e-5, atol=1e-5)


def test_stock_inductor_fuses_under_freezing_turned_on_after_the_options(fresh_compile):
    """``inductor_options()`` first, freezing set later, before the first call (the order a
    user may take): the joint-graph rewrite is in place and acts."""
    options = fusepass.inductor_options()
    model, x = MLP().eval(), _x()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        out = torch.compile(model, options=options)(x)
    assert counters["fusepass"] == {"int_mm_scaled": 2}
    torch.testing.assert_close(out, _reference(model, x), rtol=1e-5, atol=1e-5)


def test_the_joint_graph_rewrite_acts_only_where_inductor_freezes():
    """Inductor freezes with ``freezing`` set and grad off (``compile_fx``); elsewhere (a
    training graph, freezing off) the rewrite stays in the post-grad pass."""
    rewritten = []

    def on_graph(freezing, grad):
        def rewrite(gm):
            with torch._inductor.config.patch(freezing=freezing), torch.set_grad_enabled(grad):
                RewritePass()(gm.graph)
            rewritten.append(not gm.graph.find_nodes(op="call_function", target=torch.ops.aten._int_mm.default))
        return rewrite

    model, x = MLP().eval(), _x()
    for freezing, grad in ((False, False), (True, True), (True, False)):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=capture_backend(on_graph(freezing, grad)))(x)
    assert rewritten == [False, False, True]


def test_inductor_options_chain_the_joint_graph_rewrite():
    user = UserPass()
    with torch._inductor.config.patch(joint_custom_post_pass=user):
        options = fusepass.inductor_options()
    chained = options["joint_custom_post_pass"]
    assert chained.passes[0] is user and type(chained.passes[1]) is RewritePass
    assert type(options["post_grad_custom_pre_pass"]) is fusepass.FusePass  # which lowers what was rewritten
    again = fusepass.inductor_options(options)["joint_custom_post_pass"]
    assert len(again.passes) == 2 and again.uuid() == chained.uuid()
    assert RewritePass().uuid() != fusepass.FusePass().uuid()


def test_inductor_options_chain_the_users_pass(fresh_compile):
    user = UserPass()
    options = fusepass.inductor_options({"post_grad_custom_pre_pass": user})
    assert isinstance(options["post_grad_custom_pre_pass"], ChainedPass)
    model, x = MLP().eval(), _x()
    with torch.no_grad():
        out = torch.compile(model, options=options)(x)
    assert user.saw_int_mm == [True]  # the user's pass ran, first, on the unfused graph
    assert counters["fusepass"] == {"int_mm_scaled": 2}
    torch.testing.assert_close(out, _reference(model, x), rtol=1e-5, atol=1e-5)


def test_inductor_options_keep_a_configured_pass_and_never_add_ours_twice():
    user = UserPass()
    # config.patch, not monkeypatch: pytest 9.2 undoes with delattr, which deletes the key.
    with torch._inductor.config.patch(post_grad_custom_pre_pass=user):
        chained = fusepass.inductor_options()["post_grad_custom_pre_pass"]
    assert chained.passes[0] is user and isinstance(chained.passes[1], fusepass.FusePass)
    again = fusepass.inductor_options({"post_grad_custom_pre_pass": chained})["post_grad_custom_pre_pass"]
    assert again.passes[0] is user and len(again.passes) == 2
    assert chained.uuid() == again.uuid()
    # A plain function has no uuid: the chain has none either, so Inductor bypasses its cache.
    assert ChainedPass(lambda g: None, fusepass.FusePass()).uuid() is None


def test_inductor_options_round_where_eager_rounds():
    """emulate_precision_casts on by default (NOTES.md run 6: int8-asym batch-1 logits), a
    user's explicit choice kept."""
    assert fusepass.inductor_options()["emulate_precision_casts"] is True
    assert fusepass.inductor_options({"emulate_precision_casts": False})["emulate_precision_casts"] is False


def test_uuid_follows_configuration():
    default, other = fusepass.FusePass(), fusepass.FusePass(fusepass.PassConfig(fp8_max_m=8))
    assert default.uuid() == fusepass.FusePass().uuid() != other.uuid()


def test_inductor_options_keep_the_pass_config_they_are_given():
    """backend="fusepass" with options=inductor_options(config=...) keeps that PassConfig
    (it once put a default pass in its place); an explicit config wins."""
    mine = fusepass.PassConfig(fp8_max_m=32, split_k_outside_cuda_graphs=True)
    options = fusepass.inductor_options(config=mine)
    assert fusepass.inductor_options(options)["post_grad_custom_pre_pass"].config == mine
    user = UserPass()
    chained = fusepass.inductor_options({"post_grad_custom_pre_pass": ChainedPass(user, options["post_grad_custom_pre_pass"])})
    assert chained["post_grad_custom_pre_pass"].passes[1].config == mine
    other = fusepass.PassConfig(fp8_max_m=8)
    assert fusepass.inductor_options(options, config=other)["post_grad_custom_pre_pass"].config == other


def test_backend_passes_mode_and_options_to_inductor(monkeypatch):
    seen = {}
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", lambda gm, ex, config_patches: seen.update(config_patches))
    fusepass.fusepass_backend(None, [], mode="reduce-overhead", options={"max_autotune": True})
    assert seen["triton.cudagraphs"] is True and seen["max_autotune"] is True
    assert isinstance(seen["post_grad_custom_pre_pass"], fusepass.FusePass)


def test_backend_found_by_name_after_install():
    code = textwrap.dedent("""
        import sys
        from torch._dynamo.backends.registry import lookup_backend
        assert "fusepass" not in sys.modules
        fn = lookup_backend("fusepass")
        print(fn.__module__ + "." + fn.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "fusepass.backend.fusepass_backend"


_CACHE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    import fusepass
    from tests.support.models import MLP

    model = MLP().eval()
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    if sys.argv[1] == "backend":
        compiled = torch.compile(model, backend=fusepass.fusepass_backend)
    else:  # stock Inductor with the pass, configured
        config = fusepass.PassConfig(fp8_max_m=int(sys.argv[1]))
        compiled = torch.compile(model, options=fusepass.inductor_options(config=config))
    with torch.no_grad():
        compiled(x)
        # The profiler sees which ops the compiled code calls (a dispatch mode would make
        # Dynamo fall back to eager).
        with torch.profiler.profile() as prof:
            compiled(x)
    ops = {e.key for e in prof.key_averages()}
    print(json.dumps({
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "rewrites": sum(counters["fusepass"].values()),
        "inductor_counted": sum(v for k, v in counters["inductor"].items() if k.startswith("fusepass.")),
        # On CPU the fused op is lowered to its reference's int32 mm + a fused C++ epilogue.
        "lowered_mm_ran": "aten::mm" in ops,
        "int_mm_ran": "aten::_int_mm" in ops,
    }))
""")


def test_fx_graph_cache_hits_in_a_new_process_and_misses_on_new_config(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "PYTHONPATH": REPO}

    def run(how):
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(how)], capture_output=True,
                             text=True, env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second, changed = run(16), run(16), run(8)
    assert first["miss"] >= 1 and first["hit"] == 0 and first["rewrites"] == first["inductor_counted"] == 2
    # Served from the cache: the pass did not run; Inductor replays the counts it recorded.
    assert second["hit"] >= 1 and second["miss"] == 0 and second["inductor_counted"] == 2
    assert second["rewrites"] == 0  # stock Inductor does not know counters["fusepass"] (README)
    assert changed["miss"] >= 1 and changed["hit"] == 0 and changed["rewrites"] == 2
    # The fusepass backend compiles under its own Inductor choices (fusepass/choices.py), so it
    # has its own entry; on a hit of it, it restores counters["fusepass"] from the replayed counts.
    backend_first, backend = run("backend"), run("backend")
    assert backend_first["miss"] >= 1 and backend_first["hit"] == 0 and backend_first["rewrites"] == 2
    assert backend["hit"] >= 1 and backend["miss"] == 0 and backend["rewrites"] == 2
    for r in (first, second, changed, backend_first, backend):
        assert r["lowered_mm_ran"] and not r["int_mm_ran"]
