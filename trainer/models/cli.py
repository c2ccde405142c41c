"""``bulkhead export`` (a persisted checkpoint -> a Hugging Face directory) and
``bulkhead model init`` (a random Hugging Face directory of a family's preset, no network).

The checkpoint does not say which model it holds unless its plan records the job's
``spec.trainer.model``; otherwise ``--job`` names the TrainingJob manifest that trained it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import torch

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.models.protocol import ModelFamily
from bulkhead.trainer.models.registry import family

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _model_config(plan: dict[str, Any], job: Path | None) -> ModelConfig:
    if job is not None:
        from bulkhead.api.manifest import ManifestError, load_jobs

        try:
            jobs = load_jobs(job)
        except ManifestError as exc:
            raise click.ClickException(f"{job}: " + "; ".join(map(str, exc.errors))) from None
        if len(jobs) != 1:
            raise click.ClickException(f"{job}: holds {len(jobs)} TrainingJobs; pass one")
        return jobs[0].spec.trainer.model
    if "model" in plan:
        return ModelConfig.model_validate(plan["model"])
    raise click.ClickException(
        "the checkpoint does not record its model: pass --job with the TrainingJob manifest "
        "that trained it"
    )


def _hf_family(model: ModelConfig) -> ModelFamily:
    try:
        fam = family(model.family)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if fam.hf is None:
        raise click.ClickException(
            f"the {fam.name} family has no Hugging Face counterpart, so there is nothing "
            "transformers could load; bulkhead export writes the llama and mixtral families"
        )
    return fam


def _shard_bytes(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if upper.endswith(unit):
            return int(float(upper.removesuffix(unit)) * scale)
    return int(upper)


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="New directory for config.json, *.safetensors and the index.",
)
@click.option(
    "--job",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The TrainingJob manifest that trained the checkpoint (its model).",
)
@click.option("--step", type=int, default=None, help="Step to export (default: newest complete).")
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default=None,
    help="Convert the weights (default: as trained).",
)
@click.option("--shard-size", default="2GiB", show_default=True, help="Most bytes per file.")
def export(
    checkpoint: Path, out: Path, job: Path | None, step: int | None, dtype: str | None,
    shard_size: str,
) -> None:  # fmt: skip
    """Write a persisted checkpoint (CHECKPOINT: <storage>/<job> or one of its step-<n>
    directories) as a Hugging Face model that transformers' from_pretrained loads."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from bulkhead.trainer.checkpoint.persisted import CheckpointReadError, locate, persisted_params
    from bulkhead.trainer.models.hf_export import export_hf

    try:
        persisted = locate(checkpoint, step)
    except CheckpointReadError as exc:
        raise click.ClickException(str(exc)) from None
    model = _model_config(persisted.plan, job)
    fam = _hf_family(model)
    try:
        sizes = fam.sizes(model)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in fam.build(sizes).named_parameters()}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(f"reading step {persisted.step}", total=persisted.nbytes)
        try:
            params = persisted_params(persisted, shapes, lambda n: bar.advance(task, n))
        except CheckpointReadError as exc:
            raise click.ClickException(str(exc)) from None
    try:
        export_hf(params, sizes, out, _shard_bytes(shard_size), DTYPES.get(dtype or ""))
    except (ValueError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{out}: {fam.hf.architecture} of step {persisted.step} of job {persisted.job}")


@click.group("model")
def model() -> None:
    """Hugging Face model directories for the llama and mixtral families."""


@model.command("init")
@click.option("--family", "family_name", required=True, type=click.Choice(["llama", "mixtral"]))
@click.option("--preset", default="tiny", show_default=True, help="The family's preset size.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
def init(family_name: str, preset: str, out: Path, seed: int) -> None:
    """Write a Hugging Face directory with random weights (no network), e.g. to start a
    job from with spec.trainer.model.pretrained.path:

        bulkhead model init --family llama --preset tiny --out /tmp/tiny-llama
    """
    from bulkhead.trainer.models.hf_export import export_hf

    fam = family(family_name)
    try:
        sizes = fam.sizes(ModelConfig.model_validate({"family": family_name, "preset": preset}))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    torch.manual_seed(seed)
    built = fam.build(sizes)
    try:
        export_hf(dict(built.named_parameters()), sizes, out)
    except FileExistsError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{out}: {fam.hf.architecture} ({preset}, seed {seed})")
