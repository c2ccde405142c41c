"""Render the dashboard's job panels from a real local run, for the README.

Runs a TrainingJob on this machine (``bulkhead run``'s code, a worker killed on the way),
scrapes the control server's ``/metrics`` over HTTP every half second while it trains, and
plots what the dashboard's job and recovery panels show, from the same series
(``bulkhead_job_*``), with matplotlib (no Grafana can run here). Instant panels plot the
scraped value; the recovery-duration panel plots the histogram's quantile as scraped.

    .venv/bin/python -P deploy/grafana/render.py --out deploy/grafana/dashboard.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from prometheus_client.parser import text_string_to_metric_families

from bulkhead.api.manifest import load_job
from bulkhead.operator.local.runner import LocalRun, RunOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
Series = dict[str, list[tuple[float, float]]]


async def _scrape(run: LocalRun, every_s: float, into: Series, t0: float) -> None:
    """Every ``every_s``: GET /metrics from the run's control server, keep bulkhead_job_*."""
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            await asyncio.sleep(every_s)
            driver = getattr(run, "driver", None)
            if driver is None:
                continue
            try:
                text = (await client.get(f"{driver.control_url}/metrics")).text
            except httpx.HTTPError:
                continue
            now = time.monotonic() - t0
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if not s.name.startswith("bulkhead_job_"):
                        continue
                    extra = ",".join(
                        f"{k}={v}"
                        for k, v in sorted(s.labels.items())
                        if k not in ("namespace", "job")
                    )
                    into[f"{s.name}{{{extra}}}" if extra else s.name].append((now, s.value))


async def _run(job_file: Path, steps: int, chaos: str, every_s: float) -> Series:
    series: Series = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        options = RunOptions(steps=steps, chaos=chaos, run_dir=Path(tmp), live=False)
        run = LocalRun(load_job(job_file), options)
        t0 = time.monotonic()
        scraper = asyncio.create_task(_scrape(run, every_s, series, t0))
        try:
            result = await run.run()
        finally:
            scraper.cancel()
        print(f"run {result.phase}: {result.summary.get('message', '')}")
    return series


def _panel_titles() -> dict[str, str]:
    dashboard = json.loads((HERE / "bulkhead.json").read_text())
    return {p["title"]: p["targets"][0]["expr"] for p in dashboard["panels"] if p["type"] != "row"}


def plot(series: Series, out: Path) -> None:
    titles = _panel_titles()
    panels = [
        ("Phase", [("phase", "phase")]),
        ("Step", [("step", "bulkhead_job_step")]),
        ("Tokens per second", [("tokens/s", "bulkhead_job_tokens_per_second")]),
        ("Loss", [("loss", "bulkhead_job_loss")]),
        ("Workers live / desired", [("live", "bulkhead_job_workers_live"),
                                    ("desired", "bulkhead_job_workers_desired")]),
        ("Membership generation", [("generation", "bulkhead_job_membership_generation")]),
        ("Recoveries by cause", [(k.split("cause=")[1].rstrip("}"), k) for k in sorted(series)
                                 if k.startswith("bulkhead_job_recoveries_total{")]),
        ("Lost steps and restarts", [("lost steps", "bulkhead_job_lost_steps_total"),
                                     ("restarts", "bulkhead_job_restarts_total")]),
    ]  # fmt: skip
    # The phase panel as a state timeline: at each scrape, the phase whose series is 1.
    phases = ["Pending", "Running", "Recovering", "Succeeded", "Failed"]
    current: dict[float, int] = {}
    for index, phase in enumerate(phases):
        for t, value in series.get(f"bulkhead_job_phase{{phase={phase}}}", []):
            if value == 1:
                current[t] = index
    series = {**series, "phase": sorted(current.items())}
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5), constrained_layout=True)
    fig.patch.set_facecolor("#111217")
    for ax, (title, lines) in zip(axes.flat, panels, strict=True):
        assert title in titles, f"{title!r} is not a panel of the dashboard"
        ax.set_facecolor("#181b1f")
        for label, key in lines:
            points = series.get(key, [])
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=label, drawstyle="steps-post", linewidth=1.6)
        ax.set_title(title, color="#d8d9da", fontsize=10, loc="left")
        if title == "Phase":
            ax.set_yticks(range(len(phases)), phases)
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        ax.set_xlabel("seconds", color="#9fa7b3", fontsize=8)
        if lines:
            ax.legend(fontsize=7, facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235")
    fig.suptitle("bulkhead dashboard, job panels: a local run with a worker killed",
                 color="#d8d9da", fontsize=11)  # fmt: skip
    fig.savefig(out, dpi=90, facecolor=fig.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples" / "local-zero.yaml")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--chaos", default="kill:worker=1@step=40")
    parser.add_argument("--every", type=float, default=0.5, help="scrape interval (s)")
    parser.add_argument("--out", type=Path, default=HERE / "dashboard.png")
    parser.add_argument("--series", type=Path, help="also write the scraped series as JSON")
    parser.add_argument("--replay", type=Path, help="plot series written by --series; no run")
    args = parser.parse_args()
    if args.replay:
        series = json.loads(args.replay.read_text())
    else:
        series = asyncio.run(_run(args.job, args.steps, args.chaos, args.every))
    if args.series:
        args.series.write_text(json.dumps(series))
    plot(series, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
