"""The fusion pass: Inductor ``CustomGraphPass`` that rewrites quantized matmul epilogues
into fusepass op calls, joins, groups and tidies them (``PIPELINE``: the steps in order, each
with the config that enables it), then lowers those calls to the kernels they launch
(``lower.py``), so that Inductor's generated code launches them itself.

Hook point: ``post_grad_custom_pre_pass``, i.e. on the functional, decomposed ATen graph,
before Inductor's own post-grad patterns (under Inductor's freezing the rewrite runs earlier,
in the joint graph: ``RewritePass``). Those would otherwise get there first:
``fused_int_mm_mul`` and ``unfuse_bias_add_to_pointwise`` rewrite exactly the
``_int_mm -> mul -> add`` chains this pass reads (pytorch #136329, vLLM RFC #27072 on the
same choice). The cost is that Inductor's no-op removal has not run yet, so the walker
steps over no-op casts, clones and views itself.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from .._compat import CustomGraphPass, V, counters, get_hash_for_files, inductor_config
from ..kernels.policy import FP8_CUBLAS_ABOVE_M, decode_splits, splitting_outside_graphs, traced_graphs
from .graph import Rejected, aten, location, module_path, tensor_val
from .expand import NAME as EXPANDED, expand
from .group import NAME as GROUPED, group_siblings
from .join import NAME as JOINED, join_siblings
from .lower import lower
from .quantize_in import GROUPS_NAME as QUANTIZED_GROUPS_IN, NAME as QUANTIZED_IN, quantize_groups_in_gemv, quantize_in_gemv
from .patterns import PATTERNS
from .rewrite import emit
from .route import ROUTED, needs_route, route
from .share import NAME as SHARED, share_activations

log = logging.getLogger("fusepass.pass")

# The compiled graph depends on the pass, the ops' contract and the kernels the ops lower
# to, with their tuned configs: all go into uuid(), so a changed one misses the FX cache.
_PKG = Path(__file__).resolve().parent.parent
_SOURCES = tuple(sorted(
    [str(p) for d in ("passes", "ops", "kernels") for p in (_PKG / d).rglob("*") if p.suffix in (".py", ".json")]
    + [str(_PKG / "choices.py")]  # (the backend's Inductor choices)
))


# Inductor records its own counters' increments with each FX-graph-cache entry and
# replays them on a hit, when the pass does not run: each rewrite is counted there too,
# as "fusepass.<name>", so that the backend can restore counters["fusepass"] from it.
INDUCTOR_PREFIX = "fusepass."


def count(name: str) -> None:
    counters["fusepass"][name] += 1
    counters["inductor"][INDUCTOR_PREFIX + name] += 1


@dataclass(frozen=True)
class PassConfig:
    # fp8 matmuls (scaled_mm_fp8_epilogue, _direct) fuse only for a static M at most this: above it cuBLAS's
    # _scaled_mm is the faster. The measured rule is the ops' own (kernels/launch.py).
    fp8_max_m: int = FP8_CUBLAS_ABOVE_M
    # Pattern families to run, by module name (int_mm, blockwise, scaled_mm, dequant_mm).
    patterns: tuple = tuple(PATTERNS)
    # Compiled decode launches split K only inside Inductor's CUDA graphs (fusepass.kernels.
    # policy.decode_splits): outside them each split costs a launch. True where the caller
    # captures the compiled code into CUDA graphs itself (as vLLM and SGLang do), which Inductor
    # cannot see; it also turns quantize_in_gemv's default off.
    # (The backend applies it to op calls AOTAutograd traces too; stock Inductor with
    # inductor_options() to the calls the pass makes.)
    split_k_outside_cuda_graphs: bool = False
    # Sibling scaled_mm calls (one activation, 2-4 weights: q/k/v) at a static M up to this
    # run as one scaled_mm_group launch (passes/group.py), split as their joined weight would
    # be (at M <= 16 where decode launches split K: inside CUDA graphs); 0 turns grouping off.
    # 64: the pointer-load buckets (configs.POINTER_LOADS_MAX_M), the group kernel's loads; at
    # batch 64 grouping took a hand-written model to prepare's kernels
    # (docs/PERFORMANCE.md, "Why the code is as it is": "Grouping").
    group_max_m: int = 64
    # Sibling calls over touching row ranges of one weight buffer (fusepass.prepare's shared
    # buffers) run as one matmul over their union (passes/join.py), at every M.
    join_siblings: bool = True
    # At M = 1, an int8 or fp8 activation from attention (a multi-output op), or a gated MLP's
    # SiLU-mul, computed and quantized inside the M = 1 kernel, not by a kernel of its own before
    # it (passes/quantize_in.py). None: where the launches run outside CUDA graphs (as
    # decode_splits tells), where a step is bound by its launches; in CUDA graphs, where a launch
    # costs nothing, each program reading the row again made the step slower
    # (docs/PERFORMANCE.md, "Why the code is as it is": "Quantization in the M = 1 launch").
    quantize_in_gemv: bool | None = None
    # At M = 1, an fp8-block (1x128 group) activation quantized inside the M = 1 kernel
    # (passes/quantize_in.py, quantize_groups_in_gemv), in CUDA graphs too: there it brought a
    # full-depth block-wise decode step level with per-row fp8's (docs/PERFORMANCE.md).
    quantize_groups_in_gemv: bool = True
    # Fused calls whose operands are copies of one value (each hand-written linear quantizing
    # the same input itself) read the earliest copy (passes/share.py); False keeps the copies.
    share_activations: bool = True

    def __post_init__(self):
        unknown = set(self.patterns) - set(PATTERNS)
        if unknown:
            raise ValueError(f"PassConfig.patterns: unknown {sorted(unknown)}; known: {list(PATTERNS)}")


@dataclass
class Decision:
    """What the pass did with one quantized matmul (a line of ``fusepass.explain``)."""

    node: str  # the matmul node in the graph
    module: str  # the innermost nn.Module it came from ("" for a function)
    target: str  # e.g. aten._int_mm
    shapes: str  # operand shapes and dtypes
    location: str  # the user's source line, if known
    pattern: str | None = None  # the counter name, when fused
    op: str | None = None  # the fused op it became
    reason: str = ""  # why it stayed, when it did; where a fused epilogue ended early, why
    rerouted: str | None = None  # the op an int8 matmul left alone was routed to (see route.py)
    kept: str = ""  # where fused in part: what the fused kernel applies
    cost: str = ""  # where fused in part: what the steps left outside cost

    @property
    def fused(self) -> bool:
        return self.op is not None

    @property
    def partial(self) -> bool:
        """Fused, but the epilogue ended at a step it could not take (``reason`` says which)."""
        return self.fused and bool(self.reason)


def _describe(node: fx.Node) -> str:
    parts = []
    for arg in node.args[1:3] if node.target is aten.addmm.default else node.args[:2]:
        v = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if v is not None:
            parts.append(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}")
    return " x ".join(parts)


@dataclass(frozen=True)
class Step:
    """One step of the pass: ``fn(graph, config)`` rewrites the graph and returns the names of
    what it changed, each counted as ``counters["fusepass"][name]`` and logged (DEBUG) with
    ``message``; it runs where ``enabled(config)``. A ``tidy`` step (dead code, lint) runs
    where an earlier step changed the graph since its last run."""

    name: str
    fn: Callable
    enabled: Callable = lambda config: True
    message: str = ""
    tidy: bool = False

    def uuid(self, config: PassConfig) -> str:
        return f"{self.name}:{'on' if self.tidy or self.enabled(config) else 'off'}"


def fuse_patterns(graph: fx.Graph, config: PassConfig) -> list[Decision]:
    """The patterns step: each matmul node tried against ``config.patterns`` in order; the
    first that recognizes it decides (fused, left with the reason, or routed)."""
    decisions = []
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue
        for pattern in (PATTERNS[name] for name in config.patterns):
            d = _try(graph, node, pattern, config) if node.target in pattern.ANCHORS else None
            if d is not None:
                decisions.append(d)
                break
    return decisions


def _try(graph: fx.Graph, node: fx.Node, pattern, config: PassConfig) -> Decision | None:
    target = str(node.target).replace(".default", "")
    d = Decision(node.name, module_path(node), target, _describe(node), location(node))
    try:
        cand = pattern.match(node, config)
        if cand is None:
            return None
        d.op = cand.op_name
        if cand.ep.stop:
            d.kept, d.cost = cand.ep.summary(), _cost_outside(cand.last)
        emit(graph, cand)
    except Rejected as e:
        d.op, d.reason = None, str(e)
        log.debug("fusepass: left %s (%s) alone: %s", node.name, d.shapes, d.reason)
        if needs_route(node):
            route(graph, node)
            d.rerouted = "fusepass.int_mm"
            count(ROUTED)
            log.debug("fusepass: %s runs on fusepass.int_mm (torch._int_mm cannot run it on CUDA)", d.node)
        return d
    d.pattern, d.reason = cand.pattern, cand.ep.stop
    # (in the user's terms: the quantized operands, where a dequantized form's matmul is float)
    d.shapes = " x ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                          for v in (tensor_val(cand.a), tensor_val(cand.b)))
    count(cand.pattern)
    log.debug("fusepass: fused %s (%s) into %s [%s]%s", d.node, d.shapes, d.op, d.pattern,
              f", in part: {d.reason}" if d.reason else "")
    return d


def _cost_outside(last: fx.Node) -> str:
    """What a fused-in-part epilogue costs: the steps after ``last`` read its output again."""
    v = tensor_val(last)
    rows, width = v.shape[:-1], v.shape[-1]
    row_bytes = int(width) * v.element_size()
    shape = f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    if not all(isinstance(r, int) for r in rows):  # a symbolic M: per row
        amount = f"{row_bytes} bytes a row"
    else:
        total = math.prod(rows) * row_bytes
        amount = f"{total / 2**20:.1f} MiB a call" if total >= 2**20 else f"{total / 2**10:.1f} KiB a call"
    return f"the steps after it run outside the GEMM: at most one more kernel, reading its {shape} output again ({amount})"


def _quantizes_in_gemv(config: PassConfig) -> bool:
    """``config.quantize_in_gemv``, or where None, whether the launches run outside CUDA graphs."""
    if config.quantize_in_gemv is not None:
        return config.quantize_in_gemv
    graphs = traced_graphs(inductor_config().triton.cudagraphs, config.split_k_outside_cuda_graphs)
    return not decode_splits(True, False, graphs)


# The pass, in order. Each later step works on the fused ops the patterns emitted: joins and
# groups first (they take whole calls), then the quantization moved into M = 1 launches
# (which needs its row's only user), then the copies of one quantization shared (last, so that
# an in-launch quantization still finds its row). The lowering to kernel launches follows
# (``FusePass.__call__``).
PIPELINE = (
    Step(EXPANDED, lambda graph, config: expand(graph) and None, lambda config: bool(config.patterns)),
    Step("patterns", fuse_patterns, lambda config: bool(config.patterns)),
    Step(JOINED, lambda graph, config: [", ".join(n) for n in join_siblings(graph)],
         lambda config: config.join_siblings, "run as one matmul over their shared weight buffer"),
    Step(GROUPED, lambda graph, config: [", ".join(n) for n in group_siblings(graph, config.group_max_m)],
         lambda config: config.group_max_m > 0, "run as one fusepass.scaled_mm_group launch"),
    Step("dead_code", lambda graph, config: graph.eliminate_dead_code(), tidy=True),
    Step(QUANTIZED_IN, lambda graph, config: quantize_in_gemv(graph), _quantizes_in_gemv,
         "quantizes its activation in its own launch"),
    Step(QUANTIZED_GROUPS_IN, lambda graph, config: quantize_groups_in_gemv(graph),
         lambda config: config.quantize_groups_in_gemv,
         "becomes scaled_mm_blockwise_dynamic (its M = 1 kernel, where it runs, quantizes the row's 128-wide groups)"),
    Step(SHARED, lambda graph, config: share_activations(graph), lambda config: config.share_activations,
         "reads an earlier copy of its quantized activation"),
    Step("dead_code", lambda graph, config: graph.eliminate_dead_code(), tidy=True),
    Step("lint", lambda graph, config: graph.lint(), tidy=True),
)


class FusePass(CustomGraphPass):
    """Rewrite every fusable quantized matmul + epilogue in a graph into a fusepass op."""

    def __init__(self, config: PassConfig | None = None):
        self.config = config or PassConfig()  # plain data: Inductor deep-copies its config

    lowers = True  # (RewritePass: the rewrite alone)

    def __call__(self, graph: fx.Graph) -> None:
        with splitting_outside_graphs(self.config.split_k_outside_cuda_graphs):
            self.run(graph)
            if self.lowers and lower(graph):
                graph.lint()

    def run(self, graph: fx.Graph) -> list[Decision]:
        """The ``PIPELINE``'s steps in order, each where its config enables it; returns the
        decisions of the first (the patterns)."""
        decisions, changes, tidied = [], 0, {}
        for step in PIPELINE:
            if step.tidy:
                if changes > tidied.get(step.name, 0):
                    step.fn(graph, self.config)
                    tidied[step.name] = changes
                continue
            if not step.enabled(self.config):
                continue
            done = step.fn(graph, self.config) or []
            if step.name == "patterns":  # (decisions, counted by pattern as they are made)
                decisions = done
                changes += sum(d.fused or d.rerouted is not None for d in done)
                continue
            for name in done:
                changes += 1
                count(step.name)
                log.debug("fusepass: %s %s", name, step.message)
        return decisions

    def uuid(self) -> bytes:
        # Every file the steps and the lowering read (_SOURCES), the steps in force with
        # their config, and the choices in force: the backend compiles with
        # DecodeReductionChoices, stock Inductor with its own, and Inductor's own key does not
        # tell them apart (choices.py).
        choices = type(V.choices)
        handler_uuid = getattr(V.choices, "uuid", lambda: None)()  # (a handler with state of its own)
        steps = ",".join(step.uuid(self.config) for step in PIPELINE)
        return get_hash_for_files(_SOURCES, extra=f"{type(self).__name__}|{steps}|{self.config!r}|{choices.__module__}."
                                                  f"{choices.__qualname__}|{handler_uuid}")


class RewritePass(FusePass):
    """The rewrite alone (``run``), in Inductor's joint-graph hook, where Inductor's freezing follows.

    Inductor's freezing turns the weights into constants between the joint-graph passes and the
    post-grad ones, and folds what is computed from constants alone: a dequantized weight
    became an fp32 constant and its matmul a float one before the post-grad pass saw it (32
    layers: kernel time 2.6x a b1 step's, docs/PERFORMANCE.md, "Inductor's freezing"). Rewritten
    first, the weight and its scale reach freezing as a fusepass op's operands, which it cannot
    fold (the activation is an input); what only a weight needs (a view, a cast of its scale)
    it folds once. Not the lowering: its launches are mutations that return nothing, which
    freezing's dead-code removal would drop. The post-grad ``FusePass`` lowers, after finding
    nothing left to rewrite, join or group.

    It acts only where Inductor freezes, as ``compile_fx`` decides (``freezing`` set, grad off;
    read here, as the hook is set before a user may turn freezing on). With Inductor's
    ``use_joint_graph_passes`` off it does not run, and freezing folds as before.
    """

    lowers = False

    def __call__(self, graph: fx.Graph) -> None:
        if inductor_config().freezing and not torch.is_grad_enabled():
            super().__call__(graph)
