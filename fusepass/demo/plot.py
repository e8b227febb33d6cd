"""``fusepass demo --plot FILE``: the speed table as a PNG bar chart (matplotlib, imported
only here, and only when asked for)."""

from __future__ import annotations

import importlib.util

from .timing import Table

INSTALL_HINT = "--plot needs matplotlib: pip install matplotlib"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot(table: Table, title: str, path: str) -> None:
    """One panel per step (prefill latency, decode tokens/s per batch), one bar per
    (model, mode); a failed step is a labelled gap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"fusepass demo: {INSTALL_HINT}") from None

    steps = table.steps
    names = [f"{r.model}\n{r.mode}" for r in table.results]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(table.results))]
    fig, axes = plt.subplots(1, len(steps), figsize=(5 * len(steps), 0.6 * len(names) + 2), squeeze=False)
    for ax, label in zip(axes[0], steps, strict=True):
        values = []
        for r in table.results:
            s = r.seconds.get(label)
            values.append(None if s is None else s * 1e3 if label == "prefill" else int(label.split("b")[-1]) / s)
        ys = range(len(names))
        ax.barh(list(ys), [v or 0 for v in values], color=colors)
        for y, v in zip(ys, values, strict=True):
            text = " fails" if v is None else f" {v:,.0f}" if v >= 100 else f" {v:.3g}"
            ax.text(v or 0, y, text, va="center", fontsize=8)
        ax.set_yticks(list(ys), names if ax is axes[0][0] else [""] * len(names), fontsize=8)
        ax.invert_yaxis()
        unit = "ms (lower is better)" if label == "prefill" else "tokens/s (higher is better)"
        ax.set_title(f"prefill ({table.prompt_len} tokens)" if label == "prefill"
                     else f"decode, batch {label.split('b')[-1]}")
        ax.set_xlabel(unit)
        ax.margins(x=0.25)
    cpu = "CPU timings (fusepass's CPU ops are its reference implementation)"
    fig.suptitle(f"{title}\n{cpu if table.device == 'CPU' else table.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
