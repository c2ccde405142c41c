"""``bulkhead run JOB.yaml``: train a TrainingJob on this machine (local mode)."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import click
from rich.console import Console

from bulkhead.api.manifest import ManifestError, load_job
from bulkhead.operator.local.chaos import ChaosError, parse_chaos
from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.operator.local.runner import RunOptions, RunResult, effective_spec, run_local


@click.command("run")
@click.argument("job_file", type=click.Path(path_type=Path))
@click.option("--workers", type=click.IntRange(min=1, max=64), help="Override spec.workers.")
@click.option("--steps", type=click.IntRange(min=1), help="Override spec.trainer.steps.")
@click.option(
    "--chaos",
    default="",
    help="Faults to inject, comma-separated: kill:worker=1@step=40, kill:random@every=30s, "
    "hang:worker=2@step=80, kill:worker=1.1@step=40 (local rank 1 of pod 1 only).",
)
@click.option(
    "--run-dir", type=click.Path(path_type=Path), help="Run directory [default: runs/<job>]."
)
@click.option("--timeout", type=float, help="Stop the run after this many seconds.")
@click.option("--worker-command", help="Command that starts a worker [default: bulkhead-worker].")
@click.option("--no-live", is_flag=True, help="Plain log lines instead of the live panel.")
@click.option(
    "--checkpoint-sidecar/--no-checkpoint-sidecar",
    default=True,
    help="Run a bulkhead-checkpointd next to each worker, as in a worker pod [default: on]; "
    "checkpoints go to <run-dir>/checkpoints unless spec.checkpoint.storage.path is set.",
)
def run(
    job_file: Path,
    workers: int | None,
    steps: int | None,
    chaos: str,
    run_dir: Path | None,
    timeout: float | None,
    worker_command: str | None,
    no_live: bool,
    checkpoint_sidecar: bool,
) -> None:
    """Run a TrainingJob on this machine: workers are processes, faults are survived."""
    try:
        job = load_job(job_file)
    except ManifestError as exc:
        for err in exc.errors:
            click.echo(f"{job_file}: {err}", err=True)
        raise SystemExit(2) from None
    try:
        spec = effective_spec(job, workers, steps)
        parse_chaos(chaos, spec.worker_slots, spec.trainer_processes)
        options = RunOptions(
            workers=workers,
            steps=steps,
            chaos=chaos or None,
            run_dir=run_dir or Path("runs") / job.metadata.name,
            worker_command=shlex.split(worker_command) if worker_command else None,
            live=not no_live,
            timeout_s=timeout,
            checkpoint_sidecars=checkpoint_sidecar,
        )
    except (ChaosError, ManifestError) as exc:
        raise click.UsageError(str(exc)) from None
    assert options.run_dir is not None
    end_children_on_exit()  # workers and sidecars end with this process, however it ends
    options.run_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=options.run_dir / "supervisor.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result = run_local(job, options)
    _print_summary(result)
    raise SystemExit(result.exit_code)


def _print_summary(result: RunResult) -> None:
    s = result.summary
    console = Console()
    style = "bold green" if result.phase == "Succeeded" else "bold red"
    console.print(f"[{style}]{s['job']}: {result.phase}[/] {s['message']}", highlight=False)
    console.print(
        f"steps {s['steps_completed']}/{s['steps_total']}  lost steps {s['lost_steps']}  "
        f"faults injected {s['failures_injected']}  restarts {s['restarts']}  "
        f"wall {s['wall_seconds']:.1f}s",
        highlight=False,
    )
    if s["first_loss"] is not None and s["final_loss"] is not None:
        console.print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}", highlight=False)
    for i, rec in enumerate(s["recoveries"], 1):
        console.print(f"recovery {i}: {rec['cause']} in {rec['seconds']:.2f}s", highlight=False)
    console.print(f"run directory: {result.run_dir}", highlight=False)
