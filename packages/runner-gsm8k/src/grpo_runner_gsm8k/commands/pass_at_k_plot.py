"""The pass@k-by-k plot of `grpo-run report`: one line of pass@k (solid) and maj@k (dashed)
against k per evaluated model and task, from the summaries `grpo-run eval` wrote under
`<run dir>/eval/<model>/<task>/summary.json`."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

FIGURE_INCHES, DPI = (8, 5), 100


def eval_summaries(run_dir: Path) -> dict[str, dict]:
    """"<model>/<task>" -> summary, for every readable summary.json of the run's evals."""
    found = {}
    for path in sorted(run_dir.glob("eval/*/*/summary.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # an eval still running or cut off: left out
        if isinstance(summary, dict):
            found[f"{path.parent.parent.name}/{path.parent.name}"] = summary
    return found


def metric_by_k(summary: dict, metric: str) -> tuple[list[int], list[float]]:
    """(ks, values) of `metric@k` in a summary, k ascending."""
    points = sorted((int(key.split("@")[1]), float(value)) for key, value in summary.items()
                    if key.startswith(f"{metric}@") and isinstance(value, (int, float)))
    return [k for k, _ in points], [v for _, v in points]


def pass_at_k_figure(summaries: dict[str, dict]) -> Figure:
    fig = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ax.set_title("pass@k (solid) and maj@k (dashed) by k")
    ax.set_xlabel("k (samples per question)")
    ax.set_ylabel("fraction of questions")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    for name, summary in summaries.items():
        ks, values = metric_by_k(summary, "pass")
        if not ks:
            continue  # a greedy eval has no pass@k
        line, = ax.plot(ks, values, marker="o", label=f"{name} pass@k")
        maj_ks, maj_values = metric_by_k(summary, "maj")
        ax.plot(maj_ks, maj_values, marker="s", linestyle="--", color=line.get_color(), label=f"{name} maj@k")
    if ax.get_lines():
        ks = sorted({int(k) for line in ax.get_lines() for k in line.get_xdata()})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no sampled eval (eval.n > 1) found", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    return fig
