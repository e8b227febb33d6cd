"""``fusepass.explain``: which quantized matmuls of a model fuse, into what, and why not."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .backend import capture_backend
from .integrations.experts import W8A8Experts
from .passes import Decision, FusePass, PassConfig


@dataclass
class Report:
    """Every candidate quantized matmul the pass saw, fused or left alone; print it."""

    decisions: list[Decision]
    # (path, what it runs) of each fusepass.W8A8Experts of the model: its grouped GEMMs are ops the
    # module calls itself, traced into their kernels, not matmuls the pass rewrites
    experts: list = field(default_factory=list)

    @property
    def fused(self) -> list[Decision]:
        return [d for d in self.decisions if d.fused]

    @property
    def left(self) -> list[Decision]:
        return [d for d in self.decisions if not d.fused]

    @property
    def partial(self) -> list[Decision]:
        return [d for d in self.decisions if d.partial]

    def __str__(self) -> str:
        n, f, p = len(self.decisions), len(self.fused), len(self.partial)
        e = len(self.experts)
        lines = [f"fusepass: {n} quantized matmul{'s' * (n != 1)}, {f} fused, {n - f} left alone"
                 + (f" ({p} of the fused in part)" if p else "")
                 + (f"; {e} experts layer{'s' * (e != 1)} on fusepass.scaled_grouped_mm" if e else "")]
        for d in self.decisions:
            head = f"  {d.module + ': ' if d.module else ''}{d.target}({d.shapes})"
            if d.partial:
                verdict = (f"fused in part into {d.op} [{d.pattern}]: {d.kept}; the epilogue ends early: {d.reason}"
                           f"\n      cost: {d.cost}")
            elif d.fused:
                verdict = f"fused whole into {d.op} [{d.pattern}]"
            else:
                verdict = f"left alone: {d.reason}"
                if d.rerouted:
                    verdict += f"\n      runs on {d.rerouted} ({d.target} cannot run it on this device)"
            lines.append(f"{head}\n      {verdict}")
            if d.location:
                lines.append(f"      at {d.location}")
        for path, what in self.experts:
            lines.append(f"  {path}: {what}")
        return "\n".join(lines)


def explain(fn, *example_inputs, config: PassConfig | None = None, dynamic: bool | None = None,
            **example_kwargs) -> Report:
    """Trace ``fn`` (a function or module) on ``example_inputs`` (and keyword inputs
    ``example_kwargs``, e.g. ``input_ids=...`` for a transformers model) as ``torch.compile`` would,
    run the fusion pass on each graph and report every candidate quantized matmul.

    Runs ``fn`` once (traced, without Inductor code generation) under ``torch.no_grad``.
    RuntimeError where no graph reached the pass (Dynamo ran ``fn`` uncompiled), rather than an
    empty report.
    """
    decisions: list[Decision] = []
    graphs = []
    pass_ = FusePass(config)

    def on_graph(gm):
        graphs.append(gm)
        decisions.extend(pass_.run(gm.graph))

    compiled = torch.compile(fn, backend=capture_backend(on_graph), dynamic=dynamic)
    with torch.no_grad():
        compiled(*example_inputs, **example_kwargs)
    if not graphs:
        # e.g. a frame past Dynamo's recompile limit (torch._dynamo.config.recompile_limit),
        # which Dynamo then runs eagerly with only a warning: the model's forward compiled for
        # other models of its class in this process
        raise RuntimeError("fusepass.explain: torch.compile traced no graph of fn (Dynamo ran it uncompiled: "
                           "a frame past torch._dynamo.config.recompile_limit, or torch.compiler.disable); "
                           "torch._dynamo.reset() clears the compiled frames")
    return Report(decisions, _experts(fn))


def _experts(fn) -> list:
    """Each fusepass.W8A8Experts of ``fn`` (a module) and what it runs."""
    if not isinstance(fn, torch.nn.Module):
        return []
    return [(path, f"fusepass.W8A8Experts ({m.act.kind}, {m.num_experts} experts): gate/up and down as "
                   "fusepass.scaled_grouped_mm, the routing weights in down's epilogue")
            for path, m in fn.named_modules() if isinstance(m, W8A8Experts)]
