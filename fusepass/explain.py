"""``fusepass.explain``: which quantized matmuls of a model fuse, into what, and why not."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import capture_backend
from .passes import Decision, FusePass, PassConfig


@dataclass
class Report:
    """Every candidate quantized matmul the pass saw, fused or left alone; print it."""

    decisions: list[Decision]

    @property
    def fused(self) -> list[Decision]:
        return [d for d in self.decisions if d.fused]

    @property
    def left(self) -> list[Decision]:
        return [d for d in self.decisions if not d.fused]

    def __str__(self) -> str:
        n, f = len(self.decisions), len(self.fused)
        lines = [f"fusepass: {n} quantized matmul{'s' * (n != 1)}, {f} fused, {n - f} left alone"]
        for d in self.decisions:
            head = f"  {d.module + ': ' if d.module else ''}{d.target}({d.shapes})"
            verdict = f"fused into {d.op} [{d.pattern}]" if d.fused else f"left alone: {d.reason}"
            lines.append(f"{head}\n      {verdict}")
            if d.location:
                lines.append(f"      at {d.location}")
        return "\n".join(lines)


def explain(fn, *example_inputs, config: PassConfig | None = None, dynamic: bool | None = None) -> Report:
    """Trace ``fn`` (a function or module) on ``example_inputs`` as ``torch.compile`` would,
    run the fusion pass on each graph and report every candidate quantized matmul.

    Runs ``fn`` once (traced, without Inductor code generation) under ``torch.no_grad``.
    """
    decisions: list[Decision] = []
    pass_ = FusePass(config)
    compiled = torch.compile(fn, backend=capture_backend(lambda gm: decisions.extend(pass_.run(gm.graph))), dynamic=dynamic)
    with torch.no_grad():
        compiled(*example_inputs)
    return Report(decisions)
