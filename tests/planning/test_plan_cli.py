"""``bulkhead plan``: tables for a real manifest, JSON output, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from bulkhead.cli.main import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_gpu_cluster_example_fits_its_gpus_and_survives_two_losses(tmp_path: Path) -> None:
    # A Mixtral-8x7B-shaped job on the 64 nodes of 8 GPUs it asks for; its checkpoint's
    # config.json is on the cluster's PVC, so the spec's sizes are planned.
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["plan", str(EXAMPLES / "gpu-cluster.yaml"), "--fail", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps lines
    assert "Mixtral-8x7B-v0.1/config.json is not readable here" in text
    headings = (
        "Pipeline templates", "pipelines on 64 nodes", "After losing 2", "Expert placement",
        "Recovery probability", "Fits: the most loaded GPU",
    )  # fmt: skip
    for heading in headings:
        assert heading in text
    data = json.loads(out.read_text())
    memory = data["memory"]
    assert 0 < memory["maxBytesPerGpu"] <= memory["usableBytesPerGpu"] == 0.9 * 80 * 2**30
    plan = data["plan"]
    assert sum(p["microbatches"] for p in plan["pipelines"]) == 1024 // 8
    assert len(plan["pipelines"]) >= 3  # maxFailures 2 -> at least 3 replicas of each layer
    assert sorted(n for p in plan["pipelines"] for n in p["nodes"]) == sorted(
        f"node-{i}" for i in range(64)
    )
    experts = data["experts"]
    assert sum(experts["replicas"]) == 64 * 8
    assert experts["recovery"]["2"]["mro"] >= experts["recovery"]["2"]["spread"]
    assert data["reconfiguration"]["lostNodes"]


def test_plan_of_a_pretrained_job_without_its_checkpoint_or_sizes_says_what_to_do(
    tmp_path: Path,
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: bulkhead.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\n"
        "spec: {workers: 2, trainer: {model: {family: llama, pretrained: {path: /nowhere}}}}\n"
    )
    result = CliRunner().invoke(cli, ["plan", str(job)])
    assert result.exit_code != 0
    assert "spec.trainer.model.pretrained.path: /nowhere/config.json is not readable" in " ".join(
        result.output.split()
    )


def test_plan_of_a_pipeline_job_says_which_units_move_after_a_kill(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["plan", str(EXAMPLES / "local-pipeline.yaml"), "--fail", "1", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "Oobleck pipelines: 2 (3+2 stages" in result.output
    data = json.loads(out.read_text())
    assert [len(p["stages"]) for p in data["engine"]["pipelines"]] == [3, 2]
    assert [len(p["stages"]) for p in data["engineAfterFailure"]["pipelines"]] == [2, 2]
    # w0 (first stage, units 0-2) is lost: its successor at the head of the pipeline, w1,
    # fetches those units from w3, the other pipeline's first stage.
    fetched = {(f["worker"], f["unit"]): f["holders"] for f in data["engineFetches"]}
    assert fetched[("w1", 0)] == ["w3"]
    assert all(holders for holders in fetched.values())


def test_plan_of_the_composed_job_shows_each_process_stage_experts_and_state() -> None:
    result = CliRunner().invoke(cli, ["plan", str(EXAMPLES / "local-3d.yaml"), "--fail", "1"])
    assert result.exit_code == 0, result.output
    assert "Oobleck pipelines: 2 (2+1 stages" in result.output
    assert "ZeRO-3 inside each stage" in result.output
    assert "MiB" in result.output and "hosted" in result.output  # column headers
    # The two processes of the single-stage pipeline's pod host different experts.
    rows = [line for line in result.output.splitlines() if line.startswith(("│ 4 ", "│ 5 "))]
    assert len(rows) == 2 and all("│ w2 " in row for row in rows), rows
    assert "b0:0,1" in rows[0] and "b0:2,3" in rows[1], rows


def test_plan_resolves_presets() -> None:
    result = CliRunner().invoke(cli, ["plan", str(EXAMPLES / "local-moe.yaml"), "--nodes", "4"])
    assert result.exit_code == 0, result.output
    assert "pipelines on 4 nodes" in result.output


def test_plan_reports_too_few_nodes_and_bad_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["plan", str(EXAMPLES / "local-moe.yaml"), "--nodes", "1"])
    assert result.exit_code != 0
    assert "fault tolerance f=1 needs >= 2" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: bulkhead.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\n")
    result = CliRunner().invoke(cli, ["plan", str(bad)])
    assert result.exit_code != 0
    assert "spec: required field is missing" in result.output
