"""``bulkhead agent``: node agent tools for users (detector evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

import click


def _cell(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"


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
@click.option(
    "--labels",
    type=click.Path(path_type=Path, file_okay=False),
    help="Interpretation labels folder (<series>.txt with 'start-end:dims' lines) for the "
    "attribution hit rates [default: interpretation_label/ next to --data, if present].",
)
@click.option("--series", multiple=True, help="Evaluate only these series (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def evaluate(data: Path, labels: Path | None, series: tuple[str, ...], as_json: bool) -> None:
    """Fit the multivariate detector on each series' train part; score its test run.

    Point-wise precision, recall and F1 without point adjustment, per series and the mean;
    thresholds come from train data only. Beside them: the point-adjusted F1 (comparison
    only), the oracle F1 of the same scores (best threshold on the test labels: what is
    left in thresholding), and HitRate@100%/@150% of the metrics each alarm blames.
    """
    from bulkhead.agent.detect import MultivariateDetector
    from bulkhead.agent.evaluate import default_labels, summary
    from bulkhead.agent.evaluate import evaluate as run_evaluation

    header = (
        f"{'series':<12} {'precision':>9} {'recall':>7} {'F1':>6} {'F1 (PA)':>8} "
        f"{'F1 oracle':>9} {'HR@100':>7} {'HR@150':>7}"
    )

    def row(name: str, s: object) -> str:
        get = s.get if isinstance(s, dict) else lambda key: getattr(s, key)
        return (
            f"{name:<12} {_cell(get('precision'), 9)} {_cell(get('recall'), 7)} "
            f"{_cell(get('f1'), 6)} {_cell(get('f1_point_adjusted'), 8)} "
            f"{_cell(get('f1_oracle'), 9)} {_cell(get('hit_rate_100'), 7)} "
            f"{_cell(get('hit_rate_150'), 7)}"
        )

    if not as_json:
        click.echo(header)
    try:
        results = run_evaluation(
            data,
            MultivariateDetector,
            list(series) or None,
            labels=labels or default_labels(data),
            progress=None if as_json else lambda name, s: click.echo(row(name, s)),
        )
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    report = summary(results)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    means = {key[len("mean_") :]: value for key, value in report.items() if key.startswith("mean_")}
    click.echo(row("mean", means))
