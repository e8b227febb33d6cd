"""The demo's fusion report: ``fusepass.explain`` on each step graph (prefill and decode,
batch 1 and the larger batch), printed as one row per quantized linear (and per experts layer)."""

from __future__ import annotations

import torch

from ..explain import Report, explain


def explain_steps(model, steps: dict[str, dict], step) -> dict[str, Report]:
    """``{label: Report}``: explain ``model`` called with each ``steps[label]`` (keyword
    inputs), static shapes, one trace each (``step`` shows the progress)."""
    reports = {}
    for label, kwargs in steps.items():
        with step(f"tracing {label} for the fusion report"):
            torch.compiler.reset()  # a fresh cache each time: never the recompile limit
            reports[label] = explain(model, dynamic=False, **kwargs)
    return reports


def _cell(d) -> str:
    """What a linear became, in the user's terms: the fused op (the pattern that matched it is
    ``explain``'s and the counters' word), ``(in part)`` where its epilogue ended early."""
    if not d.fused:
        return "left alone"
    return d.op.removeprefix("fusepass.") + (" (in part)" if getattr(d, "partial", False) else "")


def format_reports(reports: dict[str, Report], verbose: bool = False) -> str:
    """A table of what each quantized linear became in each graph, each graph's summary,
    and why anything was left alone (``verbose``: every report in full)."""
    rows: dict[str, dict[str, str]] = {}
    for label, report in reports.items():
        seen: dict[str, int] = {}
        for d in report.decisions:
            name = d.module or d.node
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name} (#{seen[name]})"
            rows.setdefault(key, {})[label] = _cell(d)
        for path, _ in report.experts:  # (a mixture of experts' layers: W8A8Experts call the grouped op)
            rows.setdefault(path, {})[label] = "scaled_grouped_mm (experts)"
    labels = list(reports)
    widths = [max([len("module")] + [len(k) for k in rows])]
    widths += [max([len(label)] + [len(r.get(label, "-")) for r in rows.values()]) for label in labels]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    lines = [line(["module", *labels])]
    lines += [line([key, *(cells.get(label, "-") for label in labels)]) for key, cells in rows.items()]
    lines.append("")
    for label, report in reports.items():
        lines.append(f"{label}: {str(report).splitlines()[0]}")
    left = [(label, d) for label, report in reports.items() for d in report.decisions
            if not d.fused or getattr(d, "partial", False)]
    if left:
        lines.append("fused in part or left alone, and why:")
        for label, d in left:
            cost = f" (cost: {d.cost})" if getattr(d, "cost", "") else ""
            lines.append(f"  {label}, {d.module or d.node}: {d.reason}{cost}")
    if verbose:
        for label, report in reports.items():
            lines += ["", f"{label}:", str(report)]
    return "\n".join(lines)
