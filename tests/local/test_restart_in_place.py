"""A NaN restart keeps the worker pods: real launchers switch to processes their templates fork.

``bulkhead run`` of examples/local-pods.yaml (three pods of two real trainer processes,
ZeRO-2, checkpoint sidecars) with chaos ``nan`` at a step: one trainer process fills its
weights with NaN, every rank's agreed loss is NaN, the manager restarts the job, and each
live pod's launcher has its template (started before the NaN, torch imported) fork new
processes (told so by the restarting generation in its membership poll). The pods are the
same processes before and after (one launcher pid per pod, no new incarnation, no
WorkerLost), and training resumes from the checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from local_harness import read_jsonl, run_cli, wait_no_processes

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-pods.yaml"
NAME = "local-nan-pods"


def _job(tmp: Path) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["checkpoint"]["intervalSteps"] = 5
    path = tmp / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _time(line: str) -> str:
    return line[:23]  # the log's "YYYY-MM-DD HH:MM:SS,mmm": ordered as text


def test_a_nan_restart_switches_live_pods_to_processes_forked_from_their_templates(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # Late enough for every pod's template to be ready: a pod whose processes do not report
    # steps (all but rank 0's) starts its template PRESTART_SETTLE_S (10 s) into the
    # generation, and it then imports for a few seconds. At 0.2 s a step (ZeRO-2, quiet
    # machine) step 40 came 8.8 s in, before two of the three pods had a template.
    steps, nan_step = 170, 150
    proc = run_cli(str(_job(tmp_path)), "--steps", str(steps), "--run-dir", str(run_dir),
                   "--chaos", f"nan:worker=1@step={nan_step}", timeout=400)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["restarts"] == 1, summary
    events = read_jsonl(run_dir / "events.jsonl")
    reasons = [e["reason"] for e in events]
    assert "RestartingInPlace" in reasons, reasons
    assert "WorkerLost" not in reasons, [e["message"] for e in events]
    said = [e["message"] for e in events if e["reason"] == "FaultReported"]
    assert any("reported nan_loss" in m for m in said), said
    (injected,) = [e["time"] for e in events if e["reason"] == "FaultInjected"]
    recovered = [e["message"] for e in events if e["reason"] == "Recovered"]
    assert recovered and "from checkpoint" in recovered[0], recovered
    # Three pods, each one launcher for the whole run (a replaced pod is a new incarnation
    # with a log of its own).
    pods = sorted(p.name for p in (run_dir / "logs").glob(f"{NAME}-w*.log")
                  if "checkpointd" not in p.name)  # fmt: skip
    assert pods == [f"{NAME}-w{i}-0.log" for i in range(3)], pods
    nan_at = injected.replace("T", " ")[:23].replace(".", ",")
    for pod in pods:
        text = (run_dir / "logs" / pod).read_text(errors="replace")
        launchers = re.findall(
            r"launching 2 trainer processes for \S+ \(launcher pid (\d+)\)", text
        )
        assert len(launchers) == 1, (pod, launchers)
        templates = [line for line in text.splitlines()
                     if "started the template of this pod's processes" in line]  # fmt: skip
        assert len(templates) == 1, (pod, templates)  # started once, kept over the restart
        assert _time(templates[0]) < nan_at, (pod, templates[0], nan_at)  # before the NaN
        took_over = re.findall(r"local rank \d is now process (\d+) \(forked\)", text)
        assert len(took_over) == 2, (pod, took_over)
        assert "the job restarts (generation" in text, pod
    assert wait_no_processes(NAME) == []
