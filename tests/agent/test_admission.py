"""The agent reports only for its own node, on the real API server: with the token of a pod
on node A, deploy/agent/admission.yaml lets it set node A's condition and not node B's,
and the agent itself refuses to start when told node B."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from waiting import wait_until

from bulkhead.agent.reporters.kube import NotThisNode, check_own_node, credential_node
from bulkhead.agent.service import Sources, build
from bulkhead.agent.settings import AgentSettings

POLICY = Path(__file__).resolve().parents[2] / "deploy" / "agent" / "admission.yaml"

pytestmark = pytest.mark.k8s


def _policy_for(account: str, suffix: str) -> list[dict]:
    """The shipped policy, for a test account and under names of this test alone (the
    cluster is shared: the shipped names would govern the other tests' agent)."""
    docs = [d for d in yaml.safe_load_all(POLICY.read_text()) if d]
    for doc in docs:
        doc["metadata"]["name"] += f"-{suffix}"
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            doc["spec"]["policyName"] += f"-{suffix}"
        else:
            (condition,) = doc["spec"]["matchConditions"]
            shipped = "system:serviceaccount:bulkhead-system:bulkhead-agent"
            assert shipped in condition["expression"]
            condition["expression"] = condition["expression"].replace(shipped, account)
    return docs


def _pod_bound_token(cluster, namespace: str, account: str, node: str) -> str:
    """A pod of ``account`` on ``node`` and a token bound to it, as its projected token is."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": account, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "serviceAccountName": account,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "agent", "image": "bulkhead"}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    return cluster.kubectl(
        "create", "token", account, "-n", namespace,
        "--bound-object-kind=Pod", f"--bound-object-name={account}",
    ).stdout.strip()  # fmt: skip


def _list(items: list[dict]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def test_the_agent_may_patch_only_its_own_nodes_status(k8s_cluster, k8s_namespace) -> None:
    suffix = uuid.uuid4().hex[:6]
    own, other = k8s_cluster.add_gpu_nodes(2, prefix=f"adm-{suffix}")
    account = f"system:serviceaccount:{k8s_namespace}:agent"
    docs = _policy_for(account, suffix)
    k8s_cluster.kubectl("apply", "-f", "-", input=_list(docs))
    try:
        # The agent's account with the rights of deploy/agent/rbac.yaml (nodes/status patch).
        k8s_cluster.kubectl("create", "serviceaccount", "agent", "-n", k8s_namespace)
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"adm-{suffix}"},
            # deploy/agent/rbac.yaml grants nodes/status patch; kubectl patch reads it first.
            "rules": [
                {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["get", "patch"]}
            ],
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"adm-{suffix}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"adm-{suffix}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": k8s_namespace}],
        }
        k8s_cluster.kubectl("apply", "-f", "-", input=_list([role, binding]))
        token = _pod_bound_token(k8s_cluster, k8s_namespace, "agent", own)

        def patch(node: str) -> subprocess.CompletedProcess[str]:
            condition = {"type": "BulkheadAnomaly", "status": "False", "reason": "Test"}
            return k8s_cluster.kubectl(
                "patch", "node", node, "--subresource=status", f"--token={token}",
                "--kubeconfig=/dev/null", f"--server={k8s_cluster.server}",
                f"--certificate-authority={k8s_cluster.plane.ca_cert}",
                "-p", json.dumps({"status": {"conditions": [condition]}}), check=False,
            )  # fmt: skip

        # The policy is in force once it refuses the other node (admission caches it).
        attempts: list[str] = []

        def refused_other() -> subprocess.CompletedProcess[str] | None:
            result = patch(other)
            attempts.append(f"rc={result.returncode} {result.stdout} {result.stderr}".strip())
            return result if result.returncode != 0 and "may change only" in result.stderr else None

        try:
            refused = wait_until(refused_other, "the policy to refuse another node", 30, 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last answer: {attempts[-1:]}") from None
        assert "ValidatingAdmissionPolicy" in refused.stderr
        allowed = patch(own)
        assert allowed.returncode == 0, allowed.stderr
    finally:
        k8s_cluster.kubectl("delete", "-f", "-", input=_list(docs), check=False)
        k8s_cluster.kubectl(
            "delete", "clusterrolebinding,clusterrole", f"adm-{suffix}", check=False
        )
        k8s_cluster.delete_nodes([own, other])


def test_the_agent_refuses_to_start_for_another_node(k8s_cluster, k8s_namespace) -> None:
    """A wrong NODE_NAME is caught by the agent before it writes anything: its pod-bound
    token names the pod's node (SelfSubjectReview needs no RBAC)."""
    suffix = uuid.uuid4().hex[:6]
    own, other = k8s_cluster.add_gpu_nodes(2, prefix=f"own-{suffix}")
    try:
        k8s_cluster.kubectl("create", "serviceaccount", "agent-own", "-n", k8s_namespace)
        token = _pod_bound_token(k8s_cluster, k8s_namespace, "agent-own", own)
        conf = client.Configuration(
            host=k8s_cluster.server, api_key={"authorization": f"Bearer {token}"}
        )
        conf.ssl_ca_cert = str(k8s_cluster.plane.ca_cert)
        api = client.ApiClient(conf)
        assert credential_node(api, 10) == own
        check_own_node(api, own, 10)  # its own node: accepted
        with pytest.raises(NotThisNode, match=f"runs on '{own}'"):
            check_own_node(api, other, 10)
        # The agent as the DaemonSet builds it: told the other node, it does not start.
        settings = AgentSettings(node_name=other, kubernetes=True)
        with pytest.raises(NotThisNode):
            build(settings, Sources(gpu=None, kernel_log=None, api=api, host=False))
        # An admin kubeconfig names no node: the check cannot decide and lets it run.
        assert credential_node(k8s_cluster.api_client(), 10) is None
    finally:
        k8s_cluster.delete_nodes([own, other])
