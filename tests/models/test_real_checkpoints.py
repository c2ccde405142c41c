"""Checkpoints written by real ``bulkhead run`` jobs of the GPT engine read back whole: a
composed run (pipeline stages x experts x ZeRO-3 over each pod's 2 processes, 4 shards)
assembles to the parameters a data-parallel run of the same job persisted, and ``bulkhead
export`` (reading the model from the checkpoint's plan) refuses the family, which has no
Hugging Face counterpart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from click.testing import CliRunner

from bulkhead.api.spec import ModelConfig
from bulkhead.cli.main import cli
from bulkhead.trainer.checkpoint.persisted import locate, persisted_params

BULKHEAD = str(Path(sys.executable).with_name("bulkhead"))
MODEL = {"preset": "tiny-moe"}


def _gpt_shapes() -> dict[str, torch.Size]:
    try:  # the gpt family of the protocol, once the engine has moved to it
        from bulkhead.trainer.models.registry import family

        gpt = family("gpt")
        with torch.device("meta"):
            model = gpt.build(gpt.sizes(ModelConfig.model_validate(MODEL)))
    except ValueError:  # today's GPT
        from bulkhead.trainer.config import resolve_model
        from bulkhead.trainer.model import build_model

        model = build_model(resolve_model(ModelConfig.model_validate(MODEL)), 0, initialize=False)
    return {n: p.shape for n, p in model.named_parameters()}


def _start(
    tmp_path: Path, name: str, parallelism: dict[str, Any], processes: int = 1
) -> tuple[subprocess.Popen[str], Path]:
    doc = {
        "apiVersion": "bulkhead.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": 2,
            "processesPerWorker": processes,
            "trainer": {
                "model": MODEL,
                "parallelism": parallelism,
                "batch": {"globalBatchSize": 8, "microBatchSize": 2},
                "steps": 2,
                # SGD: the runs' tiny floating-point differences stay tiny (Adam's
                # normalisation would blow up those of near-zero gradients).
                "optimizer": {"name": "sgd", "lr": 0.05},
            },
            "checkpoint": {"intervalSteps": 2, "keep": 1},
        },
    }
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / name
    run = subprocess.Popen(
        [BULKHEAD, "run", str(job), "--run-dir", str(run_dir), "--no-live"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return run, run_dir / "checkpoints" / name


def _finish(run: subprocess.Popen[str]) -> None:
    try:
        output, _ = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, output


def test_a_composed_runs_checkpoint_assembles_to_the_data_parallel_one(tmp_path):
    # Both jobs at once: most of each run's wall time is process start-up and rendezvous.
    composed_run, composed = _start(
        tmp_path,
        "composed",
        {"pipeline": {"minStages": 2}, "experts": {}, "zero": {"stage": 3}},
        processes=2,
    )
    reference_run, reference = _start(tmp_path, "dp", {})
    _finish(composed_run)
    _finish(reference_run)
    shapes = _gpt_shapes()
    persisted = locate(composed)
    assert len(persisted.records) == 4  # 2 stages x 2 processes, each its own rows/experts
    mine = persisted_params(persisted, shapes)
    expected = persisted_params(locate(reference), shapes)
    assert locate(reference).step == persisted.step == 1
    for name in shapes:
        torch.testing.assert_close(mine[name], expected[name], atol=1e-4, rtol=0, msg=name)

    # Every shard records the job's model, so export needs no manifest.
    assert {r.plan["model"]["preset"] for r in persisted.records.values()} == {"tiny-moe"}
    out = CliRunner().invoke(cli, ["export", str(composed), "--out", str(tmp_path / "hf")])
    assert out.exit_code != 0 and "gpt" in out.output, out.output
    assert not (tmp_path / "hf").exists()
