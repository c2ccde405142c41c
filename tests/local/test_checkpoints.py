"""Checkpoints end to end in local mode: the real worker with its checkpoint sidecar.

Snapshots are taken every ``checkpoint.intervalSteps`` and persisted with a manifest under
the run directory; when too few workers survive, the manager keeps the survivors, replaces
the lost ones and has every worker restore, from its own shared memory, redoing only the
steps since that snapshot.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_harness import assert_samples_exact, read_jsonl, run_cli, wait_no_processes, write_job

pytestmark = pytest.mark.slow

INTERVAL = 10


def _job(tmp_path: Path, name: str, steps: int, **spec: Any) -> Path:
    path = write_job(tmp_path / "job.yaml", name, workers=2, steps=steps)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["checkpoint"] = {"intervalSteps": INTERVAL, "keep": 5}
    doc["spec"].update(spec)
    path.write_text(yaml.safe_dump(doc))
    return path


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def _no_shared_memory_left(name: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"bulkhead-{name}-*"))


def test_snapshots_are_persisted_every_interval_with_a_manifest(tmp_path: Path) -> None:
    name = "ckpt-persist"
    steps = 3 * INTERVAL
    run_dir = tmp_path / "run"
    proc = run_cli(str(_job(tmp_path, name, steps)), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _summary(run_dir)["steps_completed"] == steps
    root = run_dir / "checkpoints" / name
    expected = [INTERVAL - 1, 2 * INTERVAL - 1, 3 * INTERVAL - 1]  # the last step each holds
    assert sorted(p.name for p in root.iterdir()) == [f"step-{s:012d}" for s in expected]
    for step in expected:
        manifest = json.loads((root / f"step-{step:012d}" / "dp.manifest.json").read_text())
        assert manifest["step"] == step and manifest["job"] == name
        shards = [p for p in (root / f"step-{step:012d}").iterdir() if p.suffix == ".bin"]
        assert len(shards) == 1 and shards[0].stat().st_size == manifest["nbytes"]
    # The workers' last word (after the newest snapshot settled) names the newest step on
    # storage, and nothing failed.
    summary = _summary(run_dir)
    assert summary["last_persisted_step"] == expected[-1] and summary["persist_error"] is None
    for slot in (0, 1):  # every rank snapshots into its own shared memory
        log = (run_dir / "logs" / f"{name}-w{slot}-0.log").read_text()
        taken = [int(s) for s in re.findall(r"snapshot of step (\d+)", log)]
        assert taken == expected
        # ... and its sidecar sends each to the other slot's sidecar, whose address the
        # worker learnt from the membership (each slot stands for a node).
        assert re.search(
            r"generation 1: snapshots of shard dp \(.+\), replicated to 127\.0\.0\.1:\d+; 1 peer",
            log,
        )
        other = (run_dir / "logs" / f"{name}-w{1 - slot}-checkpointd.log").read_text()
        held = [int(s) for s in re.findall(rf"holding replica of {name}/dp step (\d+)", other)]
        # The exporter may skip a snapshot a newer one overtook; never the last one.
        assert held and set(held) <= set(expected) and held[-1] == expected[-1], other
    assert wait_no_processes(name) == []
    assert _no_shared_memory_left(name) == []


def test_too_few_survivors_restart_all_from_own_shared_memory(tmp_path: Path) -> None:
    name = "ckpt-restart"
    steps = 6 * INTERVAL
    job = _job(tmp_path, name, steps, minWorkers=2)
    run_dir = tmp_path / "run"
    kill_step = 2 * INTERVAL + 5
    chaos = f"kill:worker=1@step={kill_step}"  # 1 of 2 left < minWorkers: restart all
    proc = run_cli(str(job), "--chaos", chaos, "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\brestarts 1\b", proc.stdout), proc.stdout
    summary = _summary(run_dir)
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["restarts"] == 1 and summary["failures_injected"] == 1
    (recovery,) = summary["recoveries"]
    # The survivor (w0-0, kept) restored in place and the replacement (w1-1) at start, both
    # the same snapshot from their own shared memory (the slot's sidecar outlived w1-0).
    restored = set()
    for worker in ("w0-0", "w1-1"):
        log = (run_dir / "logs" / f"{name}-{worker}.log").read_text()
        found = re.findall(r"restored step (\d+) \(generation 1\) of dp from (\w+)", log)
        assert len(found) == 1, log
        step, tier = found[0]
        assert tier == "shm"
        restored.add(int(step))
    (step,) = restored
    assert step % INTERVAL == INTERVAL - 1 and step >= kill_step - INTERVAL
    # Only the steps since that snapshot were redone, as the manager reports them.
    resumed = [
        e["message"] for e in read_jsonl(run_dir / "events.jsonl") if e["reason"] == "Recovered"
    ]
    assert len(resumed) == 1 and f"training resumed at step {step + 1} " in resumed[0]
    lost = int(re.search(r"\((\d+) steps redone\)", resumed[0]).group(1))
    assert summary["lost_steps"] == recovery["lost_steps"] == lost
    assert 0 <= lost < INTERVAL
    assert_samples_exact(run_dir, steps)
    assert wait_no_processes(name) == []
    assert _no_shared_memory_left(name) == []


def test_a_storage_that_refuses_writes_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    """The checkpoint path cannot be created (a file stands where a directory must be: the
    way to make a write fail even as root). Training must finish, and the failure must be
    said: a warning Event once, and the summary's persist error with no persisted step."""
    name = "ckpt-refused"
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file")
    job = _job(tmp_path, name, 2 * INTERVAL)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"]["storage"] = {"path": str(blocker / "checkpoints")}
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = run_cli(str(job), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = _summary(run_dir)
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == 2 * INTERVAL
    assert summary["last_persisted_step"] is None
    assert "Not a directory" in (summary["persist_error"] or ""), summary
    failed = [
        e for e in read_jsonl(run_dir / "events.jsonl") if e["reason"] == "CheckpointPersistFailed"
    ]
    assert len(failed) == 1 and failed[0]["warning"], failed
    assert "Not a directory" in failed[0]["message"]
