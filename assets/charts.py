"""The run report's chart: accuracy and cost per query, by task."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only
import matplotlib.pyplot as plt  # noqa: E402


def accuracy_cost_chart(by_task: list[dict], path: Path, title: str) -> Path:
    """Two bar panels, one bar per task: accuracy (0-1) and mean USD per plan."""
    tasks = [r["task"] for r in by_task]
    accuracy = [r["accuracy"] or 0.0 for r in by_task]
    cost = [r["cost_per_plan_usd"] or 0.0 for r in by_task]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.0), dpi=100)
    try:
        left.bar(tasks, accuracy, color="#4c72b0")
        left.set_ylim(0, 1)
        left.set_title("accuracy")
        for x, v in enumerate(accuracy):
            left.text(x, v + 0.02, f"{v:.2f}", ha="center", fontsize=8)
        right.bar(tasks, cost, color="#dd8452")
        right.set_title("cost per plan (USD)")
        right.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
