"""The live view and the plot of a local run (rendering only, no processes)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from bulkhead.api.status import Membership, Recovery, TrainingJobStatus
from bulkhead.operator.local.plot import plan_label, plot_run
from bulkhead.operator.local.rundir import EventRow, MetricRow, RunRecorder
from bulkhead.operator.local.view import LiveView


def _status() -> TrainingJobStatus:
    return TrainingJobStatus(
        phase="Recovering",
        workers="3/4",
        membership=Membership(generation=3),
        recoveries=[Recovery(cause="SIGKILL", detected="2026-01-01T00:00:00Z", seconds=0.42)],
    )


def test_live_panel_shows_step_loss_throughput_generation_and_recoveries() -> None:
    console = Console(record=True, force_terminal=True, width=100)
    with LiveView("demo", 150, console=console) as view:
        view.on_status(_status())
        view.on_metric(
            MetricRow(t=1.0, step=41, loss=2.5, tokens_per_s=12345.0, generation=3, workers=3)
        )
        view.on_event(
            EventRow(
                t=2.0,
                reason="PlanApplied",
                message=(
                    "generation 3, step 41: experts: 4 per MoE layer | block 1: replicas [2, 1]"
                ),
                warning=False,
            )
        )
    text = console.export_text()
    for expected in ("Recovering", "42/150", "2.5000", "12,345", "3/4", "0.42s"):
        assert expected in text, expected
    # The plan row: one line per plan line, the replica counts included.
    lines = text.splitlines()
    assert any("plan" in line and "experts: 4 per MoE layer" in line for line in lines)
    assert any("block 1: replicas [2, 1]" in line for line in lines)
    panel = [line for line in lines if "PlanApplied" not in line]  # not the event line
    assert not any("experts: 4" in line and "block 1" in line for line in panel)


def test_plain_output_prints_events_and_progress_lines() -> None:
    console = Console(record=True, force_terminal=False, width=200)
    with LiveView("demo", 100, console=console) as view:
        view.on_status(_status())
        view.on_event(EventRow(t=3.0, reason="FaultInjected", message="kill w1", warning=True))
        view.on_metric(
            MetricRow(t=4.0, step=10, loss=3.0, tokens_per_s=None, generation=3, workers=3)
        )
    text = console.export_text()
    assert "FaultInjected kill w1" in text
    assert "step 11/100" in text and "gen 3" in text and "recoveries 1" in text


def test_recorder_writes_lines_and_the_plot(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, clock=iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).__next__)
    recorder.metric(0, 5.0, 100.0, 1, 2)
    recorder.event("FaultInjected", "kill", warning=True)
    recorder.event("Recovered", "ok")
    recorder.event("PlanApplied", "generation 2, step 1: generation 2: 1 worker(s), ...")
    recorder.metric(1, 4.0, 90.0, 2, 1)
    recorder.write_summary({"steps_completed": 2})
    recorder.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert '"reason": "Recovered"' in (tmp_path / "events.jsonl").read_text()
    assert (tmp_path / "summary.json").read_text().strip().endswith("}")
    png = plot_run(recorder.metrics, recorder.events, tmp_path / "plot.png", "demo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_generation_s_plan_is_named_shortly_on_the_plot() -> None:
    composed = (
        "generation 2, step 41: generation 2: 2 worker(s) x 2 processes, global batch 16 "
        "(micro 4) | Oobleck pipelines: 2 (1+1 stages, 1F1B); every layer on 2 worker(s) | "
        "ZeRO-3 inside each stage: ... | experts inside each stage, ..."
    )
    assert plan_label(composed) == "g2: 2x2 pp 1+1 ZeRO-3 EP"
    data_parallel = (
        "generation 1, step 0: generation 1: 4 worker(s), global batch 16 (micro 4) | "
        "data parallel: every worker holds the whole state (4 copies)"
    )
    assert plan_label(data_parallel) == "g1: 4w"


def test_the_validation_loss_is_shown_live_and_drawn_on_the_plot(tmp_path: Path) -> None:
    console = Console(record=True, force_terminal=False, width=200)
    rows = [
        MetricRow(t=float(s), step=s, loss=5.0 - s / 10, tokens_per_s=None, generation=1,
                  workers=2, val_loss=4.75 - s / 20 if s % 5 == 4 else None)
        for s in range(20)
    ]  # fmt: skip
    with LiveView("demo", 100, console=console) as view:
        for row in rows[:12]:
            view.on_metric(row)
    text = console.export_text()
    assert "step 11/100  loss 4.0000  val 4.3000" in text  # the newest evaluation, step 9
    live = Console(record=True, force_terminal=True, width=100)
    with LiveView("demo", 100, console=live) as view:
        for row in rows:
            view.on_metric(row)
    assert "3.8000 (after step 20)" in live.export_text()

    def orange_pixels(metrics: list[MetricRow], name: str) -> int:
        import matplotlib.image

        image = matplotlib.image.imread(plot_run(metrics, [], tmp_path / name, "demo"))
        r, g, b = image[..., 0], image[..., 1], image[..., 2]  # tab:orange is (255, 127, 14)
        return int(((r > 0.9) & (abs(g - 0.5) < 0.1) & (b < 0.2)).sum())

    assert orange_pixels(rows, "with.png") > 100
    no_eval = [MetricRow(**{**r.__dict__, "val_loss": None}) for r in rows]
    assert orange_pixels(no_eval, "without.png") == 0


def test_a_late_evaluation_of_a_recorded_step_gets_its_own_row(tmp_path: Path) -> None:
    """A generation that evaluates the step the previous one ended with (a switch right
    after it) reports that step again with its validation loss: the run dir keeps it in a
    second row of that step, and the live view shows it."""
    from bulkhead.api.manifest import parse_job
    from bulkhead.api.protocol import ProgressReport
    from bulkhead.operator.lifecycle.types import LifecycleState
    from bulkhead.operator.local.runner import LocalRun, RunOptions

    job = parse_job(
        {
            "apiVersion": "bulkhead.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "late"},
            "spec": {"workers": 1, "trainer": {"steps": 10, "eval": {"intervalSteps": 2}}},
        }
    )
    run = LocalRun(job, RunOptions(run_dir=tmp_path, live=False, checkpoint_sidecars=False))
    run._armed = True
    run._inject_due = lambda *args: None  # type: ignore[method-assign]
    recorder = RunRecorder(tmp_path, clock=iter(float(t) for t in range(100)).__next__)
    view = LiveView("late", 10, enabled=False)
    state = LifecycleState(job="late", config=None)  # type: ignore[arg-type]
    reports = [
        ProgressReport(worker="w", generation=1, step=0, loss=3.0, step_time_s=1.0,
                       tokens_per_s=10.0),
        ProgressReport(worker="w", generation=1, step=1, loss=2.9, step_time_s=1.0,
                       tokens_per_s=10.0),
        ProgressReport(worker="w", generation=2, step=1, loss=2.9, val_loss=2.75),
        ProgressReport(worker="w", generation=2, step=2, loss=2.8, step_time_s=1.0,
                       tokens_per_s=10.0),
    ]  # fmt: skip
    for report in reports:
        run._on_progress(report, state, recorder, None, view)  # type: ignore[arg-type]
    recorder.close()
    rows = [(r.step, r.generation, r.val_loss) for r in recorder.metrics]
    assert rows == [(0, 1, None), (1, 1, None), (1, 2, 2.75), (2, 2, None)]
    assert view.evaluated is not None and view.evaluated.val_loss == 2.75
