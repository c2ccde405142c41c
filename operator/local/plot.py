"""The PNG of a local run: loss (and validation loss, when the job evaluates), throughput and
workers over time; failures and recoveries marked, and each generation's plan named where
it took effect."""

from __future__ import annotations

import re
from pathlib import Path

from bulkhead.operator.local.rundir import EventRow, MetricRow


def plot_run(metrics: list[MetricRow], events: list[EventRow], path: Path, title: str) -> Path:
    """Write the plot to ``path`` (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t = [m.t for m in metrics]
    ax_loss.plot(t, [m.loss for m in metrics], color="tab:blue", lw=1.2, label="loss")
    evaluated = [m for m in metrics if m.val_loss is not None]
    if evaluated:  # a point per evaluation, joined: few points, at the steps they followed
        ax_loss.plot(
            [m.t for m in evaluated],
            [m.val_loss for m in evaluated],
            color="tab:orange",
            lw=1.2,
            marker="o",
            ms=3,
            label="validation loss",
        )
    ax_loss.set_ylabel("loss")
    ax_tput.plot(
        t,
        [m.tokens_per_s or 0.0 for m in metrics],
        color="tab:purple",
        lw=1.0,
        label="job tokens/s",
    )
    ax_tput.set_ylabel("job tokens/s\n(committed steps)")
    ax_tput.set_xlabel("time since start (s)")
    # Workers in the generation of each step: a loss and the replacement joining show as steps.
    ax_workers = ax_tput.twinx()
    ax_workers.step(t, [m.workers for m in metrics], where="post", color="tab:gray", lw=1.0)
    ax_workers.set_ylabel("workers", color="tab:gray")
    ax_workers.set_ylim(0, max((m.workers for m in metrics), default=1) + 1)
    # Injected faults mark the failures when there are any; otherwise the detected losses.
    failure_reason = (
        "FaultInjected" if any(e.reason == "FaultInjected" for e in events) else ("WorkerLost")
    )
    shown: set[str] = set()
    for event in events:
        if event.reason == failure_reason:
            style, label = {"color": "tab:red", "ls": "--"}, "failure"
        elif event.reason == "Recovered":
            style, label = {"color": "tab:green", "ls": ":"}, "recovered"
        else:
            continue
        for ax in (ax_loss, ax_tput):
            ax.axvline(event.t, lw=1.0, label=None if label in shown else label, **style)
        shown.add(label)
    plans = [e for e in events if e.reason == "PlanApplied"]
    for row, event in enumerate(plans):
        # Staggered down the loss axis so labels of nearby generations do not overlap.
        ax_loss.annotate(
            plan_label(event.message),
            xy=(event.t, 1.0 - 0.09 * (row % 4)),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color="tab:olive",
            va="top",
        )
    ax_loss.legend(loc="center right")  # plan labels run along the top
    ax_loss.set_title(title)
    ax_loss.grid(alpha=0.3)
    ax_tput.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plan_label(message: str) -> str:
    """A short name of a generation's plan from its PlanApplied message, e.g.
    ``g2: 2x2 pp 1+1 ZeRO-3 EP``."""
    parts = []
    generation = re.search(r"generation (\d+)", message)
    if generation:
        parts.append(f"g{generation.group(1)}:")
    who = re.search(r"(\d+) worker\(s\)(?: x (\d+) processes)?", message)
    if who:
        parts.append(who.group(1) + (f"x{who.group(2)}" if who.group(2) else "w"))
    stages = re.search(r"Oobleck pipelines: \d+ \(([\d+]+) stages", message)
    if stages:
        parts.append(f"pp {stages.group(1)}")
    zero = re.search(r"ZeRO-(\d)", message)
    if zero and "degraded" not in message:
        parts.append(f"ZeRO-{zero.group(1)}")
    if "experts" in message:
        parts.append("EP")
    return " ".join(parts) or message[:30]
