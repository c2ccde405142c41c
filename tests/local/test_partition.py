"""A real network partition of one worker: it costs that worker, not the job.

``bulkhead run`` runs in a network namespace of this test. Mid-run, policy-routing rules
cut the traffic of one worker process (by its uid, see ``partition_worker.py``) to all
its peers, in both directions, while it still reaches the control endpoint. Its peers'
collectives time out; every worker probes the others; the two that cannot reach it name
it, it names them both; the manager evicts the one most members named and the rest go
on in process. Its replacement (a new process, not cut off) is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from local_harness import BULKHEAD, assert_samples_exact, read_jsonl, wait_no_processes, write_job
from waiting import wait_until

VICTIM_UID = 12345
# In the test's namespace, loopback traffic goes through the rules added before "local".
ISOLATE = "ip link set lo up && ip rule add pref 100 lookup local && ip rule del pref 0 && exec "


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_jsonl(path)) if path.exists() else 0


def test_a_partitioned_worker_is_evicted_and_the_rest_go_on(tmp_path: Path) -> None:
    name = "partition"
    steps = 40
    job = write_job(
        tmp_path / "job.yaml", name, workers=3, steps=steps, hang_timeout=30,
        collective_timeout=3,
    )  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["checkpoint"] = {"intervalSteps": 1000}  # no snapshot traffic to cut
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    wrapper = f"{sys.executable} {Path(__file__).with_name('partition_worker.py')}"
    command = [BULKHEAD, "run", str(job), "--run-dir", str(run_dir), "--no-live"]
    env = {
        **os.environ,
        "PARTITION_DIR": str(tmp_path),
        "PARTITION_SLOT": "1",
        "PARTITION_UID": str(VICTIM_UID),
    }
    shell = ISOLATE + " ".join([*command, "--worker-command", repr(wrapper)])
    proc = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", shell], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _steps_done(run_dir) >= 8, "8 steps before the partition", 180, 0.2)
        port = (tmp_path / "control-port").read_text()
        for rule in (
            f"pref 10 uidrange {VICTIM_UID}-{VICTIM_UID} ipproto tcp dport {port} lookup local",
            f"pref 11 uidrange {VICTIM_UID}-{VICTIM_UID} prohibit",
        ):
            subprocess.run(
                ["nsenter", "-t", str(proc.pid), "-n", "ip", "rule", "add", *rule.split()],
                check=True, capture_output=True, timeout=10,
            )  # fmt: skip
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["restarts"] == 0
    assert [r["cause"] for r in summary["recoveries"]] == ["partition"]
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e["message"] for e in events if e["reason"] == "WorkerLost"]
    assert lost == [f"{name}-w1-0 unreachable from {name}-w0-0, {name}-w2-0 (partition)"]
    assert (run_dir / "logs" / f"{name}-w1-1.log").exists()  # the replacement started
    assert_samples_exact(run_dir, steps)
    assert wait_no_processes(name) == []
