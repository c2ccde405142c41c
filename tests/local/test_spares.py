"""``faultTolerance.spares`` in ``bulkhead run``: a spare worker takes a lost member's place.

Two workers train data parallel next to one spare (a registered worker that does not
train; whichever registers last). A killed member's place is taken in the recovery's own
generation, so the job is whole again at once; the replacement becomes the next spare and
takes the place of the next member lost. Real worker processes (torch, gloo, CPU) and
checkpoint sidecars.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from local_harness import (
    BULKHEAD,
    assert_samples_exact,
    event_messages,
    pod_process,
    wait_no_processes,
    write_job,
)
from waiting import wait_until

pytestmark = pytest.mark.slow

NAME = "spares"


def _spares(run_dir: Path) -> list[str]:
    """The workers that became spares, in order ("<worker> is a spare (...)")."""
    return [m.split()[0] for m in event_messages(run_dir, "SpareReady")]


def test_spares_take_the_place_of_lost_members_in_the_same_generation(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", NAME, workers=2, steps=600, maxFailures=1, spares=1)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"] = {"intervalSteps": 50}
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [BULKHEAD, "run", str(job), "--run-dir", str(run_dir), "--no-live"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Whichever worker registered last is the spare; the other two train.
        wait_until(lambda: _spares(run_dir), "a spare", timeout=240, every=0.2)
        spare = _spares(run_dir)[0]
        first, second = sorted({f"{NAME}-w{slot}-0" for slot in range(3)} - {spare})
        pod_process(NAME, first.removeprefix(NAME), local_rank=None).kill()
        # The replacement of the first lost member registers as the new spare; then the
        # second member is lost.
        replacement = first.removesuffix("-0") + "-1"
        wait_until(
            lambda: replacement in _spares(run_dir),
            "the replacement to become the spare",
            timeout=240,
            every=0.2,
        )
        pod_process(NAME, second.removeprefix(NAME), local_rank=None).kill()
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == 600
    assert summary["restarts"] == 0 and summary["lost_steps"] == 0
    assert len(summary["recoveries"]) == 2, summary["recoveries"]
    published = event_messages(run_dir, "MembershipPublished")
    # Generation 1, then one per loss: every loss is replaced in its own generation.
    assert len(published) == 3, published
    assert f"{first} lost" in published[1] and f"{spare} joined" in published[1]
    assert f"{second} lost" in published[2] and f"{replacement} joined" in published[2]
    assert all("2 workers" in m for m in published), published
    recovered = event_messages(run_dir, "Recovered")
    assert all("0 steps redone" in m for m in recovered), recovered
    assert_samples_exact(run_dir, 600)
    assert wait_no_processes(NAME) == []
