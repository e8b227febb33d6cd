"""The results list of ``bench_model.py``: rows appended across runs (a ``run`` id per
process), the markdown tables (ratios only within one run) and the plot of each cell's last run."""

from __future__ import annotations

import json
import os


def append(path: str, rows: list[dict]) -> None:
    """Add ``rows`` to the JSON list at ``path`` (created if missing)."""
    old = load(path) if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(old + rows, f, indent=1)


def load(path: str) -> list[dict]:
    with open(path) as f:
        rows = json.load(f)
    if not isinstance(rows, list):
        raise SystemExit(f"bench_model: {path} is not a results list")
    return rows


def _name(row: dict) -> str:
    """A row's variant, with its guard filter if it had one."""
    return row["variant"] + (f" ({row['guard_filter']})" if row.get("guard_filter") else "")


def report(rows: list[dict]) -> str:
    """A markdown table per depth: each cell's step ms and its ratio to bf16's in the same run
    (same mode and step), GPU kernel ms, the gap, the compile time, and fusepass's GEMMs."""
    bf16 = {(r["run"], r["layers"], r["mode"], r["step"]): r["step_ms"] for r in rows
            if r["variant"] == "bf16" and "step_ms" in r}
    lines = []
    for depth in sorted({r["layers"] for r in rows}):
        lines += [f"\n{depth} layers ({', '.join(sorted({r['gpu'] for r in rows if r['layers'] == depth}))})",
                  "| run | variant | mode | step | step ms | vs bf16 | kernel ms | kernels | gap ms | compile s "
                  "| GEMM ms | GEMM TB/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in [r for r in rows if r["layers"] == depth]:
            if "error" in r:
                lines.append(f"| {r['run']} | {_name(r)} | {r['mode']} | {r['step']} | fails: {r['error']} | | | | | | | |")
                continue
            base = bf16.get((r["run"], r["layers"], r["mode"], r["step"]))
            ratio = f"{base / r['step_ms']:.2f}x" if base and r["variant"] != "bf16" else ""
            gpu = [f"{r[k]:{f}}" if k in r else "" for k, f in (("kernel_ms", ".3f"), ("kernels", ".0f"), ("gap_ms", ".3f"))]
            gemm = [f"{r[k]:{f}}" if k in r else "" for k, f in (("gemm_ms", ".3f"), ("gemm_TBps", ".2f"))]
            lines.append(f"| {r['run']} | {_name(r)} | {r['mode']} | {r['step']} | {r['step_ms']:.3f} | {ratio} | "
                         f"{' | '.join(gpu)} | {r['compile_s']} | {' | '.join(gemm)} |")
    return "\n".join(lines).strip()


def plot(rows: list[dict], path: str) -> None:
    """Step time against bf16's (same run, mode and step), one panel per depth; of a cell
    timed in several runs, the last run's that has a bf16 row to compare with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16 = {(r["run"], r["layers"], r["mode"], r["step"]): r["step_ms"] for r in rows
            if r["variant"] == "bf16" and "step_ms" in r}
    latest = {(r["layers"], _name(r), r["mode"], r["step"]): r for r in rows
              if "step_ms" in r and (r["run"], r["layers"], r["mode"], r["step"]) in bf16}
    rows = list(latest.values())
    depths = sorted({r["layers"] for r in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(6 * len(depths), 4), squeeze=False)
    for ax, depth in zip(axes[0], depths, strict=True):
        cells = [(f"{r['step']}\n{r['mode']}", _name(r), bf16[r["run"], r["layers"], r["mode"], r["step"]] / r["step_ms"])
                 for r in rows if r["layers"] == depth and r["variant"] != "bf16"]
        labels = list(dict.fromkeys(c[0] for c in cells))
        names = list(dict.fromkeys(c[1] for c in cells))
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            xs = [labels.index(c[0]) + i * width for c in cells if c[1] == name]
            ax.bar(xs, [c[2] for c in cells if c[1] == name], width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylim(0, 1.4 * max([c[2] for c in cells], default=1.0))  # (room above the bars for the legend)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=8)
        ax.set_title(f"{depth} layers: speed vs bf16 (higher is better)")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
