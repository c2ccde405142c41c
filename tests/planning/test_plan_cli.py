"""``bulkhead plan``: tables for a real manifest, JSON output, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from bulkhead.cli.main import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_plan_moe_job_with_failures_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["plan", str(EXAMPLES / "gpu-cluster.yaml"), "--nodes", "16", "--fail", "2",
              "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for heading in ("Pipeline templates", "pipelines on 16 nodes", "After losing 2",
                    "Expert placement", "Recovery probability"):  # fmt: skip
        assert heading in result.output
    data = json.loads(out.read_text())
    plan = data["plan"]
    assert sum(p["microbatches"] for p in plan["pipelines"]) == 1024 // 4
    assert len(plan["pipelines"]) >= 3  # maxFailures 2 -> at least 3 replicas of each layer
    assert sorted(n for p in plan["pipelines"] for n in p["nodes"]) == sorted(
        f"node-{i}" for i in range(16)
    )
    experts = data["experts"]
    assert sum(experts["replicas"]) == 16 * 8
    assert experts["recovery"]["2"]["mro"] >= experts["recovery"]["2"]["spread"]
    assert data["reconfiguration"]["lostNodes"]


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
