"""The user CLI ``bulkhead``: one entry point whose sub-commands live with their components.

Sub-commands are imported lazily, so ``bulkhead validate`` never pays for torch and the
operator/agent packages are only imported by the commands that drive them.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from bulkhead.api.crd import crd_yaml
from bulkhead.api.manifest import ManifestError, load_jobs

# name -> "module:attribute" of a click command: next to the component it drives, or in
# cli/ when it draws on several (plan).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("bulkhead.operator.local.cli:run", "Run a TrainingJob on this machine."),
    "plan": ("bulkhead.cli.plan:plan", "Show pipeline and expert plans for a job."),
    "agent": ("bulkhead.agent.cli:agent", "Node agent tools (evaluate detectors, ...)."),
    "export": (
        "bulkhead.trainer.models.cli:export",
        "Write a persisted checkpoint as a Hugging Face model directory.",
    ),
    "model": (
        "bulkhead.trainer.models.cli:model",
        "Hugging Face model directories (init: random weights, no network).",
    ),
    "data": (
        "bulkhead.trainer.data.cli:data",
        "Prepare token shards (bulkhead data prepare) and train a small tokenizer.",
    ),
}


class LazyGroup(click.Group):
    """A click group whose heavier sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        target, help_text = LAZY_COMMANDS[cmd_name]
        module_name, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except ModuleNotFoundError as exc:
            missing = exc.name or module_name

            @click.command(
                cmd_name, help=help_text, context_settings={"ignore_unknown_options": True}
            )
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def unavailable(args: tuple[str, ...]) -> None:
                raise click.ClickException(
                    f"'bulkhead {cmd_name}' needs the module {missing!r}, which is not installed "
                    "(install bulkhead[all])."
                )

            return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bulkhead")
def cli() -> None:
    """bulkhead keeps large-model training running through hardware and software faults."""


@cli.command()
def crd() -> None:
    """Print the TrainingJob CustomResourceDefinition (YAML)."""
    click.echo(crd_yaml(), nl=False)


@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def validate(files: tuple[Path, ...]) -> None:
    """Validate TrainingJob manifests; one line per error, non-zero exit on any error."""
    bad = 0
    for path in files:
        try:
            jobs = load_jobs(path)
        except ManifestError as exc:
            bad += 1
            for err in exc.errors:
                click.echo(f"{path}: {err}", err=True)
            continue
        names = ", ".join(j.metadata.name for j in jobs)
        click.echo(f"{path}: valid ({names})")
    if bad:
        raise SystemExit(1)


def main() -> None:
    cli(prog_name="bulkhead")


if __name__ == "__main__":
    main()
