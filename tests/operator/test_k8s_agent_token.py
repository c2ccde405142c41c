"""The agents' token rotated while the operator runs: the operator reads it from its file
(the mounted Secret the kubelet rewrites) for each new job, so jobs made after the rotation
get report tokens derived from the new one, without a restart. (The agents' side, which
admits the new token and the one it replaced: tests/agent/test_app.py.)"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from k8s_operator_harness import OperatorProcess, ensure_crd, job_manifest, wait_until

from bulkhead.api.protocol import job_report_token

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def _agent_token(cluster, namespace: str, job: str) -> str | None:
    found = cluster.kubectl(
        "get", "secret", f"{job}-control", "-n", namespace, "-o", "json", check=False
    )
    if found.returncode != 0:
        return None
    value = (json.loads(found.stdout).get("data") or {}).get("agent-token")
    return base64.b64decode(value).decode() if value else None


def test_jobs_made_after_a_rotation_get_the_new_agents_token(
    k8s_cluster, k8s_namespace, tmp_path: Path, monkeypatch
) -> None:
    ensure_crd(k8s_cluster)
    token_file = tmp_path / "agents-token"
    token_file.write_text("agents-token-1\n")
    monkeypatch.setenv("BULKHEAD_OPERATOR_AGENT_REPORT_TOKEN_FILE", str(token_file))
    operator = OperatorProcess(k8s_cluster.kubeconfig, k8s_namespace, tmp_path / "op.log")
    operator.start()
    try:
        for job, agents_token in (("before", "agents-token-1"), ("after", "agents-token-2")):
            token_file.write_text(f"{agents_token}\n")
            manifest = job_manifest(job, k8s_namespace, "no-such-zone", 2)
            k8s_cluster.kubectl("apply", "-f", "-", input=manifest)
            expected = job_report_token(agents_token, f"{k8s_namespace}.{job}")
            wait_until(
                lambda j=job, e=expected: _agent_token(k8s_cluster, k8s_namespace, j) == e,
                f"{job}: its report token derived from {agents_token}",
            )
        assert _agent_token(k8s_cluster, k8s_namespace, "before") == job_report_token(
            "agents-token-1", f"{k8s_namespace}.before"
        )  # a running job's pods keep theirs: the agents admit the replaced token
    finally:
        operator.stop()
        print(operator.logs()[-5000:])
