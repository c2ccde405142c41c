"""`bulkhead agent evaluate` and `bulkhead-agent`, run as real subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

from agent_helpers import planted_dataset

REPO = Path(__file__).resolve().parents[2]


def _bulkhead(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "bulkhead.cli.main", *args],
        capture_output=True, text=True, cwd=REPO, timeout=240,
    )  # fmt: skip


def test_evaluate_json_shape(tmp_path):
    data = planted_dataset(tmp_path)
    out = _bulkhead("agent", "evaluate", "--data", str(data), "--series", "srv-2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["series"]) == {"srv-2"}
    series = report["series"]["srv-2"]
    assert {"precision", "recall", "f1", "f1_oracle", "hit_rate_100", "hit_rate_150"} <= set(series)
    assert report["mean_f1"] == series["f1"] > 0.5
    assert series["f1_oracle"] >= series["f1"]
    # the labels next to the data were found; the planted metrics are blamed
    assert report["mean_hit_rate_150"] == series["hit_rate_150"] >= 0.9


def test_evaluate_table_and_errors(tmp_path):
    data = planted_dataset(tmp_path)
    out = _bulkhead("agent", "evaluate", "--data", str(data))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "series", "precision", "recall", "F1", "F1", "(PA)", "F1", "oracle", "HR@100", "HR@150"
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[1:]] == ["srv-1", "srv-2", "mean"]
    missing = _bulkhead("agent", "evaluate", "--data", "/nonexistent/asd.npz")
    assert missing.returncode != 0 and "dataset not found" in missing.stderr
    unknown = _bulkhead("agent", "evaluate", "--data", str(data), "--series", "omi-99")
    assert unknown.returncode != 0 and "unknown series" in unknown.stderr
    no_labels = _bulkhead("agent", "evaluate", "--data", str(data), "--labels", "/nonexistent")
    assert no_labels.returncode != 0 and "interpretation labels folder" in no_labels.stderr


def test_agent_entry_point_rejects_a_bad_config(tmp_path):
    config = tmp_path / "agent.yaml"
    config.write_text("interval_s: -1\nno_such_key: 1\n")
    out = subprocess.run(
        [sys.executable, "-P", "-m", "bulkhead.agent.main", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "interval_s" in out.stderr and "no_such_key" in out.stderr


def test_the_agent_never_imports_torch():
    code = (
        "import sys, bulkhead.agent.service, bulkhead.agent.main, bulkhead.agent.cli, "
        "bulkhead.agent.replay, bulkhead.agent.reporters.kube; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
