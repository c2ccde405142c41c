"""A wall clock stepped forward or back on the operator's node changes no deadline.

Deadlines (hang and registration timeouts, backoff, Lease renewals, the untaint wait) run
on monotonic clocks. Two proofs with real components: the untaint wait against the real
API server with node stamps a day old (what a clock stepped a day forward looks like),
and a whole `bulkhead run` whose supervisor sees ``time.time`` jump an hour forward and
two hours back mid-job (tests/local/clock_jump.py) while its workers train.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bulkhead.api.node_problems import CONDITION_TYPE, rfc3339
from bulkhead.operator.k8s import names
from bulkhead.operator.k8s.kube import KubeClient, load_credentials
from bulkhead.operator.k8s.nodes import NodeActions

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS / "local"))
from local_harness import FAKE_WORKER, read_jsonl, write_job  # noqa: E402

CLOCK_JUMP = TESTS / "local" / "clock_jump.py"


def _taint(cluster, node: str) -> dict | None:
    taints = cluster.get_json("node", node)["spec"].get("taints") or []
    return next((t for t in taints if t["key"] == names.TAINT_UNHEALTHY), None)


def _healthy_since(cluster, node: str, when: datetime) -> None:
    stamp = rfc3339(when)
    conditions = [
        {"type": "Ready", "status": "True", "reason": "KubeletReady"},
        {"type": CONDITION_TYPE, "status": "False", "reason": "NoAnomaly"},
    ]
    for c in conditions:
        c.update(lastHeartbeatTime=stamp, lastTransitionTime=stamp, message="bulkhead test")
    cluster.kubectl(
        "patch", "node", node, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"conditions": conditions}}),
    )  # fmt: skip


@pytest.mark.k8s
def test_the_untaint_wait_runs_on_the_operators_own_clock(k8s_cluster) -> None:
    """Stamps a day old (our wall clock stepped a day forward, or a node's clock behind)
    do not untaint at once: the operator waits the full time from when it saw the node
    healthy, and a new transition starts the wait again."""
    node = f"clock-{uuid.uuid4().hex[:6]}"
    taint = {"key": names.TAINT_UNHEALTHY, "value": "XidError", "effect": "NoSchedule"}
    manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    manifest["spec"] = {"taints": [taint], "unschedulable": True}
    k8s_cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))
    try:
        day_ago = datetime.now(UTC) - timedelta(days=1)
        _healthy_since(k8s_cluster, node, day_ago)
        now = [1000.0]

        async def scenario() -> list[bool]:
            client = KubeClient(load_credentials(k8s_cluster.kubeconfig))
            actions = NodeActions(client, "default", clock=lambda: now[0])
            removed = []
            try:
                removed.append(await actions.maybe_untaint(node, 300))  # first seen healthy
                now[0] += 299
                removed.append(await actions.maybe_untaint(node, 300))
                # It fell sick and healed again (a new transition): the wait starts over.
                # 23 h ago: a stamp other than the first at any hour of the day.
                await asyncio.to_thread(
                    _healthy_since, k8s_cluster, node, day_ago + timedelta(hours=1)
                )
                now[0] += 10
                removed.append(await actions.maybe_untaint(node, 300))
                now[0] += 299
                removed.append(await actions.maybe_untaint(node, 300))
                now[0] += 1
                removed.append(await actions.maybe_untaint(node, 300))
            finally:
                await client.close()
            return removed

        assert asyncio.run(scenario()) == [False, False, False, False, True]
        assert _taint(k8s_cluster, node) is None
    finally:
        k8s_cluster.delete_nodes([node])


def test_a_supervisor_whose_wall_clock_jumps_keeps_training_without_a_recovery(
    tmp_path: Path,
) -> None:
    """`bulkhead run` with time.time stepped +1 h, then -2 h, mid-training (hang timeout 3 s):
    no member is declared hung or late, the job runs every step in one generation."""
    job = write_job(tmp_path / "job.yaml", "clock", workers=2, steps=40, hang_timeout=3.0)
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-P", str(CLOCK_JUMP), "run", str(job), "--run-dir", str(run_dir),
        "--no-live", "--no-checkpoint-sidecar", "--worker-command", shlex.join(FAKE_WORKER),
    ]  # fmt: skip
    env = {**os.environ, "FAKE_MODE": "train", "FAKE_STEP_SECONDS": "0.1"}
    env["CLOCK_JUMPS"] = "10:3600,25:-7200"  # +1 h after 10 steps, -2 h after 25
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    supervisor = (run_dir / "supervisor.log").read_text()
    assert "wall clock stepped by +3600 s" in proc.stderr
    assert "wall clock stepped by -7200 s" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == 40, summary
    assert summary["restarts"] == 0 and not summary.get("recoveries"), summary
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(40))
    assert "hang" not in supervisor.lower(), supervisor[-4000:]
