"""The ``fusepass`` torch.compile backend, and the pass as options for stock Inductor.

    torch.compile(model, backend="fusepass")                    # found via entry point
    torch.compile(model, options=fusepass.inductor_options())   # stock Inductor + the pass

Both keep Inductor's FX graph cache on: the pass is a CustomGraphPass with a uuid(). The
backend also compiles with Inductor choices of its own (``choices.py``). Tensor-subclass
weights (torchao's) it compiles as AOTAutograd gives them; ``fusepass.prepare(model)`` turns
them into plain tensors once, which is what takes their per-call cost away
(``integrations/prepare.py``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import torch

from ._compat import (
    CustomGraphPass, aot_capture, compile_fx, counters, inductor_config, is_traceable_wrapper_subclass, mode_options,
    register_backend,
)
from .kernels.policy import splitting_outside_graphs
from .passes import FusePass, PassConfig, RewritePass
from .choices import decode_reductions
from .passes.fuse_pass import INDUCTOR_PREFIX

log = logging.getLogger("fusepass")
_HOOK = "post_grad_custom_pre_pass"  # why this hook: fusepass/passes/fuse_pass.py
_FREEZING_HOOK = "joint_custom_post_pass"


class ChainedPass(CustomGraphPass):
    """The user's own pass, then fusepass's: theirs sees the graph they wrote it for (under
    Inductor's freezing, the post-grad one sees fusepass's ops: ``RewritePass``).

    Its uuid() combines the members' uuids; a member without one (a plain function)
    makes it None, which turns Inductor's FX graph cache off rather than risk a stale hit.
    """

    def __init__(self, *passes):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self):
        ids = []
        for p in self.passes:
            uid = p.uuid() if isinstance(p, CustomGraphPass) else None
            if uid is None:
                return None
            ids.append(uid if isinstance(uid, bytes) else repr(uid).encode())
        return hashlib.sha256(b"|".join(ids)).hexdigest()


def _without_fusepass(p):
    """``p`` with any fusepass pass taken out (so chaining twice never runs it twice)."""
    if isinstance(p, FusePass):
        return None
    if isinstance(p, ChainedPass):
        rest = [q for q in map(_without_fusepass, p.passes) if q is not None]
        return None if not rest else rest[0] if len(rest) == 1 else ChainedPass(*rest)
    return p


def _fusepass_in(p) -> FusePass | None:
    """The fusepass pass in a post-grad hook (itself, or a member of a chain), if any."""
    if isinstance(p, FusePass):
        return p
    if isinstance(p, ChainedPass):
        return next((f for f in map(_fusepass_in, p.passes) if f is not None), None)
    return None


def inductor_options(options: dict | None = None, *, config: PassConfig | None = None) -> dict:
    """Inductor options (for ``torch.compile(..., options=...)``) that add the fusepass pass.

    A ``post_grad_custom_pre_pass`` already in ``options``, or else already set in
    ``torch._inductor.config``, is kept and runs first (chained, never replaced); a fusepass
    pass among them is replaced by one pass, with ``config``, or else with its own config
    (so ``backend="fusepass"`` keeps the ``PassConfig`` of ``options=inductor_options(...)``).
    Sets ``emulate_precision_casts`` unless ``options`` says otherwise (see below). Also
    chains ``RewritePass`` in ``joint_custom_post_pass`` the same way: where Inductor freezes,
    the rewrite runs there, before freezing folds the weights' dequantization (and a user's
    post-grad pass then sees fusepass's ops, no longer the quantized matmuls).
    """
    opts = dict(options or {})
    # Round where eager rounds (a bf16 value fused into the next kernel is otherwise kept in
    # fp32). The fused ops take the activation's quantized values, scale and zero point from
    # Inductor's kernels; without it a torchao int8-asym Llama layer's batch-1 logits were
    # 2.94e-2 from the float model's against eager torchao's 2.29e-2; with it 2.25e-2
    # (relative error, H200). An explicit False is kept.
    opts.setdefault("emulate_precision_casts", True)
    found = _fusepass_in(opts.get(_HOOK, getattr(inductor_config(), _HOOK)))
    if config is None and found is not None:
        config = found.config
    _chain(opts, _HOOK, FusePass(config))
    _chain(opts, _FREEZING_HOOK, RewritePass(config))  # (acts where Inductor freezes)
    return opts


def _chain(opts: dict, hook: str, ours: FusePass) -> None:
    """Put ``ours`` in ``opts[hook]``, after the user's pass there (in ``opts``, else in
    ``torch._inductor.config``) and in place of any fusepass pass."""
    existing = _without_fusepass(opts.get(hook, getattr(inductor_config(), hook)))
    opts[hook] = ours if existing is None else ChainedPass(existing, ours)


def _counts() -> tuple[Counter, Counter]:
    inductor = Counter({k[len(INDUCTOR_PREFIX):]: v for k, v in counters["inductor"].items()
                        if k.startswith(INDUCTOR_PREFIX)})
    return Counter(counters["fusepass"]), inductor


def _hint_prepare(example_inputs) -> None:
    """Say once per process where a graph takes torchao's tensor-subclass weights: each costs
    host time on every call (Dynamo's guards, AOTAutograd taking it apart), which
    ``fusepass.prepare`` removes."""
    global _HINTED
    subclasses = sum(isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x)
                     and type(x).__module__.startswith("torchao") for x in example_inputs)
    if subclasses and not _HINTED:
        _HINTED = True
        log.warning("fusepass: this graph takes %d torchao tensor-subclass weights, and each costs host time on "
                    "every call (Llama-3-8B, batch 1: 0.62x bf16's speed this way, 1.40x prepared; H100). Call "
                    "fusepass.prepare(model) before torch.compile: it turns them into plain tensors once "
                    "(docs/PREPARE.md).", subclasses)


_HINTED = False


def fusepass_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """The ``fusepass`` backend: Inductor with the fusion pass; takes ``mode=``/``options=``
    as ``torch.compile`` passes them (e.g. ``mode="reduce-overhead"`` for CUDA graphs).
    Inductor keeps decode-size row reductions in one kernel here (``choices.py``).

    On an FX-graph-cache hit the pass does not run; ``counters["fusepass"]`` is filled
    from the counts Inductor replays from the cache entry (see ``fuse_pass.count``)."""
    patches = mode_options(mode) if mode else {}
    patches.update(options or {})
    (ours, inductor) = _counts()
    _hint_prepare(example_inputs)
    options = inductor_options(patches)
    # (op calls AOTAutograd traces before the pass runs take the pass's split decision too)
    split = _fusepass_in(options[_HOOK]).config.split_k_outside_cuda_graphs
    with decode_reductions(patches), splitting_outside_graphs(split):
        compiled = compile_fx(gm, example_inputs, config_patches=options)
    (ours_now, inductor_now) = _counts()
    counters["fusepass"].update((inductor_now - inductor) - (ours_now - ours))  # replayed, not counted
    return compiled


def capture_backend(on_graph):
    """A backend that stops where the pass runs: AOT-trace with Inductor's decompositions
    and joint-graph passes (the graph the pass sees inside Inductor), call ``on_graph(gm)``,
    then run the graph eagerly. For ``explain`` and tests: no Inductor code generation."""
    def forward_compiler(gm, example_inputs):
        on_graph(gm)
        gm.recompile()
        return gm.forward

    return aot_capture(forward_compiler)


def _register_name() -> None:
    """``backend="fusepass"`` from a source tree too (on ``PYTHONPATH``, no pip install):
    where no installed distribution declares the ``torch_dynamo_backends`` entry point (which
    finds the backend without an import), register the name on import. Not where one does:
    loading the entry point imports this module, and torch then registers the name itself
    (a second registration is an error there)."""
    from importlib.metadata import entry_points

    if entry_points(group="torch_dynamo_backends", name="fusepass"):
        return
    register_backend(fusepass_backend, name="fusepass")


_register_name()
