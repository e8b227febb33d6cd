"""Tensor parallelism: two CPU processes on gloo, one pool for the whole module.

- the DTensor sharding rules of the ops (``fusepass/ops/sharding.py``): each op on DTensors
  under each rule against the op on the whole tensors in one process, and which output
  placement DTensor chose (Partial only where it is exact);
- ``fusepass.distributed``'s styles on the Llama-style model of ``examples/tp_llama.py``:
  every quantized linear fuses on each rank, in the local graph DTensor desugars to
  (capture backend, no Inductor code generation), and once compiled for real with
  ``backend="fusepass"`` (``run`` of the example: counters, explain, numerics);
- on a machine with 2 GPUs, the example itself under torchrun (nccl).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

from fusepass.passes import PassConfig  # noqa: E402
from fusepass.passes.group import NAME as GROUPED  # noqa: E402
from tests.support.blockwise_data import make_block_problem  # noqa: E402
from tests.passes.harness import fused_calls  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2


# --- the process pool ----------------------------------------------------------------------


def _worker(rank, init_file, conn):
    import fusepass  # noqa: F401  registers the ops and their sharding rules

    # Two ranks share the CI machine's two cores: one thread each, and Inductor compiles in
    # the rank's process (a pool of compile workers per rank would import torch twice more).
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))  # a cold compile on a busy CI core
    while (task := conn.recv()) is not None:
        fn, args = task
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    """WORLD spawned processes in one gloo group; ``run(fn, *args)`` calls ``fn(*args)`` on
    every rank and returns the results by rank. Spawning costs each test module one import
    of torch and fusepass per rank, not one per test. After a failure the processes are
    replaced (a rank may be stuck in a collective its peer never joined)."""

    def __init__(self):
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")  # never fork a process that has run torch
        self.init_file = tempfile.mktemp(prefix="fusepass-gloo-")
        self.conns, self.procs = [], []
        for rank in range(WORLD):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.init_file, theirs), daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, fn, *args, timeout: float = 600):
        for conn in self.conns:
            conn.send((fn, args))
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            # Once a rank has failed, the others may wait for it in a collective: not long.
            wait = 10 if errors else timeout
            try:
                if not conn.poll(wait):
                    errors.append(f"rank {rank}: no answer in {wait} s")
                    continue
                status, value = conn.recv()
            except (EOFError, OSError):
                errors.append(f"rank {rank}: its process died (exit code {self.procs[rank].exitcode})")
                continue
            results.append(value)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close(kill=True)
            self._start()
            raise AssertionError("\n".join(errors))
        return results

    def close(self, kill: bool = False):
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive() and not kill:
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=0 if kill else 30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


# --- the sharding rules --------------------------------------------------------------------

M, K, N = 6, 64, 10  # N = 10: 5 columns a rank; M = 6: 3 rows


def _problem():
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)  # a row-major weight
    return dict(
        a=torch.randint(-128, 128, (M, K), generator=g, dtype=torch.int8), w=w,
        sa=torch.rand(M, 1, generator=g) / 64, sb=torch.rand(1, N, generator=g) / 64,
        bias=torch.randn(N, generator=g), azp=torch.randint(-20, 20, (M,), generator=g, dtype=torch.int32),
        colsum=w.sum(1, dtype=torch.int32),
    )


def _rule_case(case: str):
    """Case ``case`` of RULE_CASES on this rank: the op on DTensors (b = w.t() of a weight
    distributed as given), and the same op on the whole tensors. Returns the output's
    placements, whether it equals the 1-process result exactly, and the max relative error."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, p = _mesh(), _problem()
    f32, ops = torch.float32, torch.ops.fusepass
    R, S0, S1 = Replicate(), Shard(0), Shard(1)

    def d(name, placement):
        return distribute_tensor(p[name], mesh, [placement])

    def partial(t):  # a term each rank holds part of: rank 0 all of it, the others zeros
        return DTensor.from_local(t if dist.get_rank() == 0 else torch.zeros_like(t), mesh, [Partial()])

    local_w = d("w", S1).to_local()  # this rank's K slice: its column sums are its share
    local_colsum = DTensor.from_local(local_w.sum(1, dtype=torch.int32), mesh, [Partial()])
    a, b, sa, sb, bias, azp, colsum = (p[k] for k in ("a", "w", "sa", "sb", "bias", "azp", "colsum"))
    b = b.t()
    one = torch.tensor(0.01)
    # Block-wise fp8 (a [8, 256], b = w.t() [256, 256]): each rank builds its own row slice
    # locally, as gloo cannot scatter fp8.
    bp = make_block_problem(8, 256, 256, seed=0)
    blockwise = (bp.a, bp.b, bp.scale_a, bp.scale_b)
    rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    blockwise_local = (bp.a[rows], bp.b, bp.scale_a[rows], bp.scale_b)
    single, sharded = {
        "scaled_mm columns": (
            lambda: ops.scaled_mm(a, b, sa, sb, f32, bias),
            lambda: ops.scaled_mm(d("a", R), d("w", S0).t(), d("sa", R), d("sb", S1), f32, d("bias", S0))),
        "scaled_mm columns, [N] and per-tensor scales, bf16": (
            lambda: ops.scaled_mm(a, b, one, sb.reshape(N), torch.bfloat16),
            lambda: ops.scaled_mm(d("a", R), d("w", S0).t(), distribute_tensor(one, mesh, [R]),
                                  distribute_tensor(sb.reshape(N), mesh, [S0]), torch.bfloat16)),
        "scaled_mm rows": (
            lambda: ops.scaled_mm(a, b, sa, sb, f32, bias),
            lambda: ops.scaled_mm(d("a", S0), d("w", R).t(), d("sa", S0), d("sb", R), f32, d("bias", R))),
        "scaled_mm contraction": (
            lambda: ops.scaled_mm(a, b, sa, sb, f32),
            lambda: ops.scaled_mm(d("a", S1), d("w", S1).t(), d("sa", R), d("sb", R), f32)),
        "scaled_mm contraction, replicated bias": (
            lambda: ops.scaled_mm(a, b, sa, sb, f32, bias),
            lambda: ops.scaled_mm(d("a", S1), d("w", S1).t(), d("sa", R), d("sb", R), f32, d("bias", R))),
        "scaled_mm contraction, partial bias": (
            lambda: ops.scaled_mm(a, b, sa, sb, f32, bias),
            lambda: ops.scaled_mm(d("a", S1), d("w", S1).t(), d("sa", R), d("sb", R), f32, partial(bias))),
        "scaled_mm_azp per-token, columns": (
            lambda: ops.scaled_mm_azp(a, b, sa, sb, f32, colsum, azp, bias),
            lambda: ops.scaled_mm_azp(d("a", R), d("w", S0).t(), d("sa", R), d("sb", S1), f32,
                                      d("colsum", S0), d("azp", R), d("bias", S0))),
        "scaled_mm_azp per-token, rows": (
            lambda: ops.scaled_mm_azp(a, b, sa, sb, f32, colsum, azp),
            lambda: ops.scaled_mm_azp(d("a", S0), d("w", R).t(), d("sa", S0), d("sb", R), f32,
                                      d("colsum", R), d("azp", S0))),
        "scaled_mm_azp per-token, contraction, partial colsum": (
            lambda: ops.scaled_mm_azp(a, b, sa, sb, f32, colsum, azp),
            lambda: ops.scaled_mm_azp(d("a", S1), d("w", S1).t(), d("sa", R), d("sb", R), f32,
                                      local_colsum, d("azp", R))),
        "scaled_mm_azp per-token, contraction, replicated colsum": (
            lambda: ops.scaled_mm_azp(a, b, sa, sb, f32, colsum, azp),
            lambda: ops.scaled_mm_azp(d("a", S1), d("w", S1).t(), d("sa", R), d("sb", R), f32,
                                      d("colsum", R), d("azp", R))),
        "scaled_mm_azp per-tensor, contraction, partial azp_adj": (
            lambda: ops.scaled_mm_azp(a, b, sa, sb, f32, 3 * colsum),
            lambda: ops.scaled_mm_azp(d("a", S1), d("w", S1).t(), d("sa", R), d("sb", R), f32, 3 * local_colsum)),
        "fusepass.int_mm contraction": (
            lambda: ops.int_mm(a, b),
            lambda: ops.int_mm(d("a", S1), d("w", S1).t())),
        "aten._int_mm columns": (
            lambda: torch._int_mm(a, b),
            lambda: torch._int_mm(d("a", R), d("w", S0).t())),
        "aten._int_mm contraction": (
            lambda: torch._int_mm(a, b),
            lambda: torch._int_mm(d("a", S1), d("w", S1).t())),
        "scaled_mm_blockwise rows": (
            lambda: ops.scaled_mm_blockwise(*blockwise, torch.bfloat16),
            lambda: ops.scaled_mm_blockwise(*[DTensor.from_local(t, mesh, [pl]) for t, pl in zip(blockwise_local, (S0, R, S0, R))],
                                            torch.bfloat16)),
    }[case]
    ref, out = single(), sharded()
    full = out.full_tensor()
    err = ((full.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    return out.placements[0], torch.equal(full, ref), err


# case: (the output placement DTensor must choose, exact: equal to the 1-process result bit
# for bit; else the ranks' fp32 partial results summed, a few roundings off)
RULE_CASES = {
    "scaled_mm columns": (Shard(1), True),
    "scaled_mm columns, [N] and per-tensor scales, bf16": (Shard(1), True),
    "scaled_mm rows": (Shard(0), True),
    "scaled_mm contraction": (Partial("sum"), False),
    # A replicated bias would be added once per rank: no Partial rule; DTensor redistributes.
    "scaled_mm contraction, replicated bias": (Replicate(), True),
    "scaled_mm contraction, partial bias": (Partial("sum"), False),
    "scaled_mm_azp per-token, columns": (Shard(1), True),
    "scaled_mm_azp per-token, rows": (Shard(0), True),
    "scaled_mm_azp per-token, contraction, partial colsum": (Partial("sum"), False),
    "scaled_mm_azp per-token, contraction, replicated colsum": (Replicate(), True),
    "scaled_mm_azp per-tensor, contraction, partial azp_adj": (Partial("sum"), False),
    "fusepass.int_mm contraction": (Partial("sum"), True),  # int32 sums: exact
    "aten._int_mm columns": (Shard(1), True),
    "aten._int_mm contraction": (Partial("sum"), True),
    "scaled_mm_blockwise rows": (Shard(0), True),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_sharding_rule(ranks, case):
    placement, exact = RULE_CASES[case]
    for rank, (got, equal, err) in enumerate(ranks.run(_rule_case, case)):
        assert got == placement, f"rank {rank}: {case}: output {got}, expected {placement}"
        assert equal if exact else err < 1e-6, f"rank {rank}: {case}: relative error {err:.3g}"


def _refusals():
    """What each style says of a module it cannot shard."""
    from torch import nn
    from torch.distributed.tensor.parallel import parallelize_module

    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int8DynamicActivationInt8WeightConfig,
                                      PerBlock, quantize_)

    from fusepass.distributed import QuantColwiseParallel, TorchaoColwiseParallel, TorchaoRowwiseParallel

    class Odd(nn.Module):  # a weight, and a [N, 2] tensor that is neither per-channel nor per-tensor
        def __init__(self):
            super().__init__()
            self.register_buffer("wq", torch.zeros(4, 8, dtype=torch.int8))
            self.register_buffer("table", torch.zeros(4, 2))

    _torchao_fp8_on_cpu()
    blockwise = nn.Linear(384, 256, bias=False).to(torch.bfloat16)  # K = 384: 192 a rank, not on 128-blocks
    quantize_(blockwise, Float8DynamicActivationFloat8WeightConfig(
        granularity=(PerBlock([1, 128]), PerBlock([128, 128])), set_inductor_config=False))
    int8 = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    quantize_(int8, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    messages = []
    for module, style, src in ((nn.Linear(8, 4), QuantColwiseParallel(), 0), (Odd(), QuantColwiseParallel(), 0),
                               (nn.Linear(8, 4, bias=False), TorchaoColwiseParallel(), 0),
                               (nn.Linear(8, 4), TorchaoColwiseParallel(), None),
                               (nn.Linear(8, 5, bias=False), TorchaoColwiseParallel(), None),
                               (nn.Linear(7, 4, bias=False), TorchaoRowwiseParallel(), None),
                               (blockwise, TorchaoRowwiseParallel(), None), (int8, TorchaoColwiseParallel(), None)):
        try:
            parallelize_module(module, _mesh(), style, src_data_rank=src)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_styles_refuse_what_they_cannot_shard(ranks):
    pytest.importorskip("torchao")
    for messages in ranks.run(_refusals):
        assert messages[:-1] == [
            "Linear: no 2-D weight `wq` [N, K] to shard (pass weight=NAME to the style); its tensors: "
            "['weight', 'bias']",
            "Odd: `table` (4, 2) is neither per-channel (N = 4 elements) nor per-tensor; cannot shard it column-wise",
            "TorchaoColwiseParallel (Linear): each rank slices its own copy of the quantized weight (a torchao tensor "
            "cannot be scattered): build and quantize the same model on every rank and pass src_data_rank=None to "
            "parallelize_module",
            "TorchaoColwiseParallel (Linear): a bias is not supported: on DTensors F.linear with a bias runs aten.addmm, "
            "which torchao's quantized weights do not implement",
            "TorchaoColwiseParallel (Linear): weight (5, 8) does not split in 2 equal parts along dim 0",
            "TorchaoRowwiseParallel (Linear): weight (4, 7) does not split in 2 equal parts along dim 1",
            "TorchaoRowwiseParallel (Linear): weight (256, 384) does not split in 2 equal parts along dim 1 on its "
            "128-wide scale blocks",
        ]
        assert messages[-1].startswith("TorchaoColwiseParallel (Linear): DTensor cannot hold its Int8Tensor weight ("), \
            messages[-1]
        assert messages[-1].endswith("torchao's fp8 Float8Tensor can"), messages[-1]


# --- the sharded model ---------------------------------------------------------------------


def _config():
    from examples.tp_llama import Config

    # Small, so that a compile is quick; still 2 heads and 1 kv head per rank.
    return Config(dim=128, layers=1, heads=4, kv_heads=2, ffn=256, vocab=256, max_len=16)


PROMPT = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
STEPS = {"prefill": (PROMPT, torch.arange(8)), "decode": (PROMPT[:, :1], torch.tensor([8]))}


def _capture(quant: str, step: str):
    """The sharded model's ``step`` through the capture backend (the graph the pass sees in
    Inductor, run eagerly after the pass), against the 1-process model."""
    from examples.tp_llama import build, rel_err, shard
    from tests.passes.harness import run_pass

    args = STEPS[step]
    with torch.no_grad():
        single = build(_config(), quant, torch.float32, "cpu")
        single.setup_cache(1)
        ref = single(*args)
        model = shard(build(_config(), quant, torch.float32, "cpu"), _mesh(), 1, quant)
    r = run_pass(model, *args)
    return r.decisions, r.before, r.after, rel_err(r.out, ref)


def _dtensor_keeps_partial_through_mul() -> bool:
    """Whether this torch's DTensor keeps ``replicated * partial`` Partial (2.13 does; 2.11
    follows the first operand and all-reduces the partial one)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = _mesh()
    x = distribute_tensor(torch.ones(4, 1, dtype=torch.int32), mesh, [Replicate()])
    y = DTensor.from_local(torch.ones(1, 8, dtype=torch.int32), mesh, [Partial()])
    return (x * y).placements[0].is_partial()


def _check_decisions(rank, decisions, M, patterns, left=frozenset(), dtype="int8"):
    """Every quantized linear of the 1-layer model fused whole on this rank (but those in
    ``left``) by one of ``patterns``, on the local shapes: a column-wise linear's N and a
    row-wise one's K halved (dim 128, 4 heads of 32, ffn 256, vocab 256)."""
    t = dtype
    shapes = {"layers.0.attention.wq": f"{t}[{M}, 128] x {t}[128, 64]",
              "layers.0.attention.wk": f"{t}[{M}, 128] x {t}[128, 32]",
              "layers.0.attention.wo": f"{t}[{M}, 64] x {t}[64, 128]",
              "layers.0.feed_forward.w1": f"{t}[{M}, 128] x {t}[128, 128]",
              "layers.0.feed_forward.w2": f"{t}[{M}, 128] x {t}[128, 128]",
              "output": f"{t}[{M}, 128] x {t}[128, 128]"}
    patterns = {patterns} if isinstance(patterns, str) else patterns
    assert len(decisions) == 8, f"rank {rank}: {[d.module for d in decisions]}"
    for d in decisions:
        assert d.fused == (d.module not in left) and not d.partial, f"rank {rank}: {d}"
        assert not d.fused or d.pattern in patterns, f"rank {rank}: {d}"
        assert d.module not in shapes or d.shapes == shapes[d.module], f"rank {rank}: {d.module}: {d.shapes}"


# (int8, prefill): test_example_compiles_with_the_backend_and_matches_one_process
@pytest.mark.parametrize("quant, step", [("int8", "decode"), ("int8-asym", "prefill")])
def test_sharded_model_fuses_every_linear_on_each_rank(ranks, quant, step):
    pattern = {"int8": "int_mm_scaled", "int8-asym": "int_mm_azp_per_token"}[quant]
    left = set()
    if quant == "int8-asym" and not ranks.run(_dtensor_keeps_partial_through_mul)[0]:
        # torch 2.11: DTensor all-reduces the row-wise colsum and re-splits `azp * colsum`
        # by dividing it by the world size, in fp32: no longer an int32 zero-point term.
        left = {"layers.0.attention.wo", "layers.0.feed_forward.w2"}
    for rank, (decisions, before, after, err) in enumerate(ranks.run(_capture, quant, step)):
        _check_decisions(rank, decisions, STEPS[step][0].numel(), pattern, left)
        # The collectives DTensor desugars to: an all-reduce(max) of each row-wise linear's
        # per-token maxima (and min with zero points), an all-reduce(sum) of each one's
        # output, the head's all-gather; all outside the fused ops.
        assert before.count("_c10d_functional.all_reduce(") >= 4 and "all_gather_into_tensor" in before
        assert fused_calls(after) == 8 - len(left) and after.count("aten._int_mm(") == len(left)
        assert err < 1e-6, f"rank {rank}: relative error {err:.3g} vs the 1-process model"


def _torchao_fp8_on_cpu() -> None:
    """torchao refuses to quantize to fp8 without a GPU of compute capability >= 8.9, by a
    check before it quantizes; the rest runs on a CPU (``torch._scaled_mm`` has an fp8 CPU
    path), so these tests lift that check in the rank processes."""
    import torchao.quantization.quant_api as quant_api

    assert callable(quant_api._check_hardware_support)  # a torchao without it: update this test
    quant_api._check_hardware_support = lambda granularity: None


def _capture_torchao(step: str):
    """The torchao-fp8 model sharded with the Torchao styles, through the pass (as
    ``_capture``): its relative error against the sharded model run eagerly, and the errors
    of the fused, the eager sharded and the 1-process torchao models against the unquantized
    model (on one process)."""
    from examples.tp_llama import TORCHAO, build, rel_err, shard
    from tests.passes.harness import run_pass

    _torchao_fp8_on_cpu()
    args, bf16 = STEPS[step], torch.bfloat16  # torchao's per-row fp8 takes bf16 weights only
    with torch.no_grad():
        unquantized = build(_config(), None, bf16, "cpu")
        unquantized.setup_cache(1)
        single = build(_config(), TORCHAO, bf16, "cpu")
        single.setup_cache(1)
        model = shard(build(_config(), TORCHAO, bf16, "cpu"), _mesh(), 1, TORCHAO)
        ref, eager = unquantized(*args), model(*args)
        errs = {"eager": rel_err(eager, ref), "1 process": rel_err(single(*args), ref)}
    # Each rank holds its shard only, not a view of the whole fp8 weight.
    qdata = [m.weight.to_local().qdata for m in model.modules() if isinstance(m, torch.nn.Linear)]
    errs["compact"] = all(q.untyped_storage().nbytes() == q.numel() for q in qdata) and len(qdata) == 8
    r = run_pass(model, *args)
    errs["fused"] = rel_err(r.out, ref)
    return r.decisions, r.before, r.after, rel_err(r.out, eager), errs


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_torchao_fp8_model_fuses_every_linear_on_each_rank(ranks, step):
    """torchao's fp8 under the Torchao styles: DTensor shards at the mm, torchao's subclass runs
    on the shards, and the pass sees torchao's local epilogues (on CPU the fp8 rule fuses at every M)."""
    pytest.importorskip("torchao")
    for rank, (decisions, before, after, err, errs) in enumerate(ranks.run(_capture_torchao, step)):
        _check_decisions(rank, decisions, STEPS[step][0].numel(), {"scaled_mm_fp8_direct", "scaled_mm_fp8_epilogue"},
                         dtype="float8_e4m3fn")
        # Row-wise: each rank quantizes its own K slice (no all-reduce of maxima, unlike the
        # hand-written styles), then the all-reduce(sum) of its output after the fused op.
        assert before.count("_c10d_functional.all_reduce(") == 2 and "all_gather_into_tensor" in before
        assert fused_calls(after) == 8 and "aten._scaled_mm" not in after
        assert errs["compact"], f"rank {rank}: a shard keeps the whole weight's storage"
        # The numerics policy (DESIGN.md): the fused model as close to the unquantized one as
        # the unfused graph, here the sharded model run eagerly, and as the 1-process model
        # (whose per-token scales differ). The fused logits differ from the eager ones by
        # 2e-2: w1's fused op keeps its output in fp32 for the SiLU, where torchao rounds it
        # to bf16 first (scaled_mm_fp8_epilogue), which moves some later fp8 roundings.
        assert errs["fused"] <= 1.05 * min(errs["eager"], errs["1 process"]), f"rank {rank}: {err:.3g}, {errs}"


def _unquantized_sharded():
    """The example's baseline: the unquantized model under PyTorch's own styles, eagerly."""
    from examples.tp_llama import build, rel_err, shard

    with torch.no_grad():
        single = build(_config(), None, torch.float32, "cpu")
        single.setup_cache(1)
        model = shard(build(_config(), None, torch.float32, "cpu"), _mesh(), 1, None)
        return {step: rel_err(model(*args), single(*args)) for step, args in STEPS.items()}


def test_example_baseline_shards_the_unquantized_model(ranks):
    for rank, errs in enumerate(ranks.run(_unquantized_sharded)):
        assert all(e < 1e-6 for e in errs.values()), f"rank {rank}: {errs}"


def _example(quant: str, new_tokens: int = 0):
    from examples.tp_llama import TORCHAO, run

    torch._dynamo.reset()
    if quant == TORCHAO:
        _torchao_fp8_on_cpu()
    dtype = torch.bfloat16 if quant == TORCHAO else torch.float32
    return run(_mesh(), _config(), quant, PROMPT, new_tokens=new_tokens, reps=0, dtype=dtype)


def _rewrites(counters: dict) -> dict:
    """The pattern counters, without the grouping of siblings (q/k/v at decode sizes)."""
    return {k: v for k, v in counters.items() if k != GROUPED}


def test_example_compiles_with_the_backend_and_matches_one_process(ranks):
    """The example's ``run`` (int8 prefill), Inductor for real: one compile per rank."""
    for rank, r in enumerate(ranks.run(_example, "int8")):
        assert r.linears == 8 and _rewrites(r.counters) == {"int_mm_scaled": 8}, f"rank {rank}: {r.counters}"
        _check_decisions(rank, r.report.decisions, PROMPT.numel(), "int_mm_scaled")
        assert r.err_single < 1e-6 and r.ok, f"rank {rank}: {r.err_single:.3g}, {r.err_float}"


def test_example_compiles_the_torchao_model(ranks):
    """The example's ``run`` with torchao's fp8 and one decode step (M = 8 and 1: the fp8 rule
    fuses), Inductor for real: every linear fused on each rank in both graphs, and explained
    as compiled (static M), as close to the unquantized model as 1 process."""
    pytest.importorskip("torchao")
    patterns = {"scaled_mm_fp8_direct", "scaled_mm_fp8_epilogue"}
    for rank, r in enumerate(ranks.run(_example, "torchao-fp8", 1)):
        rewrites = _rewrites(r.counters)
        assert r.linears == 8 and sum(rewrites.values()) == 16 and set(rewrites) <= patterns, \
            f"rank {rank}: {r.counters}"
        _check_decisions(rank, r.report.decisions, PROMPT.numel(), patterns, dtype="float8_e4m3fn")
        _check_decisions(rank, r.decode_report.decisions, 1, patterns, dtype="float8_e4m3fn")
        assert r.ok, f"rank {rank}: {r.err_float}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode, quant", [("default", "int8"), ("reduce-overhead", "int8"), ("default", "torchao-fp8")])
def test_example_under_torchrun_on_two_gpus(mode, quant):
    if quant == "torchao-fp8":
        pytest.importorskip("torchao")
    # Its own session, so that a hang (the NCCL communicator waiting at exit for CUDA graphs
    # that captured its all-reduces) kills the ranks too and fails here.
    path = os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))  # keep the caller's (torchao)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/tp_llama.py",
         "--device", "cuda", "--layers", "1", "--new-tokens", "4", "--reps", "3", "--mode", mode, "--quant", quant],
        cwd=REPO, env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"no exit in 300 s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    # fp8 fuses at a static M <= PassConfig.fp8_max_m only (the fp8 rule): the 32-token prefill too.
    fused = quant == "int8" or 32 <= PassConfig().fp8_max_m
    prefill = "8 fused, 0 left alone" if fused else "0 fused, 8 left alone"
    for rank in range(2):
        assert f"[rank {rank}] prefill graph, fusepass.explain: fusepass: 8 quantized matmuls, {prefill}" in stdout, stdout
        assert f"[rank {rank}] decode graph, fusepass.explain: fusepass: 8 quantized matmuls, 8 fused, 0 left alone" \
            in stdout, stdout
        assert f"[rank {rank}] compiled with backend='fusepass'" in stdout
        assert f"[rank {rank}] NVIDIA" in stdout and f"torch.compile {mode} mode" in stdout, stdout
    assert stdout.count("-> OK") == 2, stdout


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--quant", "torchao-fp8"],
     "--quant torchao-fp8 needs --device cuda: torchao quantizes to fp8 only on GPUs of compute capability >= 8.9"),
    (["--device", "cuda", "--quant", "torchao-fp8", "--dtype", "float32"],
     "--quant torchao-fp8 needs bfloat16 activations: torchao's per-row fp8 takes bf16 weights only"),
    (["--device", "cuda", "--prompt-len", "16"],
     "on cuda --batch x --prompt-len must be > 16: the eager 1-process reference runs torch._int_mm"),
])
def test_example_refuses_flags_it_cannot_run(argv, message, capsys):
    from examples.tp_llama import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
