"""`bulkhead agent evaluate` and `bulkhead-agent`, run as real subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

ASD = Path(__file__).resolve().parents[3] / "shared" / "data" / "asd" / "asd.npz"
REPO = Path(__file__).resolve().parents[2]


def _bulkhead(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "bulkhead.cli.main", *args],
        capture_output=True, text=True, cwd=REPO, timeout=240,
    )  # fmt: skip


def test_evaluate_json_shape():
    assert ASD.is_file(), f"the ASD dataset is missing: expected {ASD}"
    out = _bulkhead("agent", "evaluate", "--data", str(ASD), "--series", "omi-2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"mean_f1", "mean_f1_point_adjusted", "series"}
    assert set(report["series"]) == {"omi-2"}
    series = report["series"]["omi-2"]
    assert {"precision", "recall", "f1"} <= set(series)
    assert report["mean_f1"] == series["f1"] > 0


def test_evaluate_table_and_errors():
    out = _bulkhead("agent", "evaluate", "--data", str(ASD), "--series", "omi-5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["series", "precision", "recall", "F1", "F1", "(PA)"]
    assert lines[1].startswith("omi-5") and lines[-1].startswith("mean")
    missing = _bulkhead("agent", "evaluate", "--data", "/nonexistent/asd.npz")
    assert missing.returncode != 0 and "dataset not found" in missing.stderr
    unknown = _bulkhead("agent", "evaluate", "--data", str(ASD), "--series", "omi-99")
    assert unknown.returncode != 0 and "unknown series" in unknown.stderr


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
