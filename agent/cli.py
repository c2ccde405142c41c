"""``bulkhead agent``: node agent tools for users (detector evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.group("agent")
def agent() -> None:
    """Node agent tools (evaluate detectors, ...)."""


@agent.command()
@click.option(
    "--data",
    "data",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Labelled dataset (.npz with <series>_train, _test, _test_label arrays).",
)
@click.option("--series", multiple=True, help="Evaluate only these series (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def evaluate(data: Path, series: tuple[str, ...], as_json: bool) -> None:
    """Fit the multivariate detector on each series' train part; score its test flags.

    Point-wise precision, recall and F1 without point adjustment (the point-adjusted F1 is
    shown beside it only for comparison), per series and the mean; thresholds come from
    train data only.
    """
    from bulkhead.agent.detect import MultivariateDetector
    from bulkhead.agent.evaluate import evaluate as run_evaluation
    from bulkhead.agent.evaluate import summary

    try:
        results = run_evaluation(data, MultivariateDetector, list(series) or None)
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    report = summary(results)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{'series':<12} {'precision':>9} {'recall':>7} {'F1':>6} {'F1 (PA)':>8}")
    for name, s in results.items():
        click.echo(
            f"{name:<12} {s.precision:>9.3f} {s.recall:>7.3f} {s.f1:>6.3f} "
            f"{s.f1_point_adjusted:>8.3f}"
        )
    click.echo(
        f"{'mean':<12} {'':>9} {'':>7} {report['mean_f1']:>6.3f} "
        f"{report['mean_f1_point_adjusted']:>8.3f}"
    )
