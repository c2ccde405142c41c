"""Pod and node classification, the evict/untaint patches and the status write policy."""

from datetime import UTC, datetime

import pytest

from bulkhead.api.node_problems import CONDITION_TYPE
from bulkhead.api.protocol import WorkerExit
from bulkhead.operator.k8s import classify, names
from bulkhead.operator.k8s.status_writer import is_significant, write_delay


def _pod(phase="Running", trainer_state=None, **status):
    statuses = [{"name": "trainer", "state": trainer_state or {"running": {}}}]
    return {
        "metadata": {"name": "j-w0-0"},
        "spec": {"nodeName": "n1"},
        "status": {"phase": phase, "containerStatuses": statuses, **status},
    }


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (_pod(), ("running", None, "")),
        (_pod("Pending", {"waiting": {"reason": "ContainerCreating"}}), ("pending", None, "")),
        (
            _pod("Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
            ("exited", 137, "OOMKilled"),
        ),
        (
            _pod("Failed", {"terminated": {"exitCode": 2, "reason": "Error"}}),
            ("exited", 2, "Error"),
        ),
        (
            _pod("Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}}),
            ("exited", 0, "Completed"),
        ),
        (_pod("Failed", {"running": {}}, reason="Evicted"), ("exited", None, "Evicted")),
        (_pod("Failed", {"running": {}}, reason="NodeShutdown"), ("exited", None, "NodeLost")),
        (_pod("Unknown"), ("exited", None, "NodeLost")),
        (
            _pod("Pending", {"waiting": {"reason": "InvalidImageName"}}),
            ("exited", WorkerExit.USER_ERROR, "InvalidImageName"),
        ),
    ],
)
def test_classify_pod(pod, expected):
    seen = classify.classify_pod(pod)
    assert (seen.state, seen.exit_code, seen.reason) == expected


def test_exit_codes_split_user_and_infrastructure_failures():
    def code(c):
        return classify.classify_pod(_pod("Failed", {"terminated": {"exitCode": c}}))

    assert code(137).infrastructure_failure and code(137).signal == 9
    assert code(1).infrastructure_failure
    assert not code(WorkerExit.USER_ERROR).infrastructure_failure  # fail fast
    assert not code(WorkerExit.STOPPED).infrastructure_failure
    assert not code(WorkerExit.DONE).infrastructure_failure


def test_deleted_running_pod_is_an_exit():
    seen = classify.classify_pod(_pod(), deleted=True)
    assert (seen.state, seen.reason, seen.node) == ("exited", "Deleted", "n1")
    disrupted = _pod(
        conditions=[
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
        ]
    )
    disrupted["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert classify.classify_pod(disrupted).reason == "DeletionByTaintManager"


def _node(ready="True", anomaly=None, taints=(), unschedulable=False, when="2026-01-01T00:00:00Z"):
    conditions = [{"type": "Ready", "status": ready, "lastTransitionTime": when}]
    if anomaly is not None:
        status, reason, message = anomaly
        conditions.append(
            {
                "type": CONDITION_TYPE,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": when,
            }
        )
    return {
        "metadata": {"name": "gpu-1", "resourceVersion": "7", "annotations": {}},
        "spec": {"taints": list(taints), "unschedulable": unschedulable},
        "status": {"conditions": conditions},
    }


def test_node_problems_and_severity():
    assert classify.node_problems(_node()) == []
    (p,) = classify.node_problems(_node(anomaly=("True", "XidError", "xid 79")))
    assert (p.reason, p.severity) == ("XidError", "critical")
    (p,) = classify.node_problems(_node(anomaly=("True", "Straggler", "")))
    assert p.severity == "warning"
    (p,) = classify.node_problems(_node(anomaly=("True", "Straggler", "severity=critical slow")))
    assert p.severity == "critical"
    (p,) = classify.node_problems(_node(anomaly=("True", "Straggler", "critical: rank 3: slow")))
    assert p.severity == "critical"
    (p,) = classify.node_problems(_node(anomaly=("True", "XidError", "warning: gpu0: xid 31")))
    assert p.severity == "warning"
    assert classify.node_problems(_node(anomaly=("False", "XidError", ""))) == []
    problems = classify.node_problems(_node("Unknown", ("True", "ThermalThrottle", "")))
    assert [p.reason for p in problems] == ["NodeUnreachable", "ThermalThrottle"]


def test_evict_patch_cordons_taints_and_is_idempotent():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    other = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
    node = _node(taints=[other])
    patch = classify.evict_patch(node, "Xid/79 (critical)", now)
    assert patch["spec"]["unschedulable"] is True
    assert other in patch["spec"]["taints"]
    ours = patch["spec"]["taints"][-1]
    assert ours == {"key": names.TAINT_UNHEALTHY, "value": "Xid-79", "effect": "NoSchedule"}
    assert patch["metadata"]["resourceVersion"] == "7"
    assert patch["metadata"]["annotations"][names.ANNOTATION_CORDONED] == "true"
    assert classify.evict_patch(_node(taints=[other, ours]), "again", now) is None
    # A node an admin already cordoned is not marked as cordoned by us.
    admin = classify.evict_patch(_node(unschedulable=True), "XidError", now)
    assert names.ANNOTATION_CORDONED not in admin["metadata"]["annotations"]


def test_untaint_policy():
    ours = {"key": names.TAINT_UNHEALTHY, "value": "XidError", "effect": "NoSchedule"}
    healed_at = datetime(2026, 1, 1, tzinfo=UTC)
    node = _node(
        anomaly=("False", "NoAnomaly", ""),
        taints=[ours],
        unschedulable=True,
        when="2026-01-01T00:00:00Z",
    )
    node["metadata"]["annotations"][names.ANNOTATION_CORDONED] = "true"
    assert classify.healthy_since(node) == healed_at
    # Default policy: the taint stays until an admin removes it.
    assert classify.untaint_patch(node, None, 600) is None
    # The wait is what the operator watched on its own clock, however old the stamps.
    assert classify.untaint_patch(node, 300, 10) is None
    assert classify.untaint_patch(node, 300, None) is None
    patch = classify.untaint_patch(node, 300, 300)
    assert patch["spec"] == {"taints": [], "unschedulable": False}
    # Still anomalous: never untainted.
    sick = _node(anomaly=("True", "XidError", ""), taints=[ours])
    assert classify.untaint_patch(sick, 300, 600) is None
    # Cordoned by an admin (no annotation): the cordon stays.
    del node["metadata"]["annotations"][names.ANNOTATION_CORDONED]
    assert "unschedulable" not in classify.untaint_patch(node, 300, 600)["spec"]


def test_status_write_policy():
    base = {"phase": "Running", "step": 10, "membership": {"generation": 1}}
    assert write_delay(None, base, 0.0, 2.0) == 0.0
    assert write_delay(base, base, 0.0, 2.0) is None
    progressed = {**base, "step": 11}
    assert not is_significant(base, progressed)
    # The live/desired worker count moves with every pod start: rate-limited like progress.
    assert not is_significant(base, {**base, "workers": "5/10"})
    assert write_delay(base, progressed, 0.5, 2.0) == pytest.approx(1.5)
    assert write_delay(base, progressed, 5.0, 2.0) == 0.0
    regenerated = {**base, "membership": {"generation": 2}}
    assert write_delay(base, regenerated, 0.1, 2.0) == 0.0
    assert write_delay(base, {**base, "phase": "Recovering"}, 0.1, 2.0) == 0.0


def test_node_signature_changes_only_with_what_bulkhead_reads():
    base = _node(anomaly=("False", "NoAnomaly", ""))
    same = _node(anomaly=("False", "NoAnomaly", ""), when="2026-01-02T00:00:00Z")
    same["metadata"]["labels"] = {"new": "label"}
    same["metadata"]["resourceVersion"] = "8"
    same["status"]["conditions"].append({"type": "MemoryPressure", "status": "True"})
    same["status"]["images"] = [{"names": ["x"]}]
    assert classify.node_signature(same) == classify.node_signature(base)
    changed = [
        _node("False", ("False", "NoAnomaly", "")),
        _node(anomaly=("True", "XidError", "xid 79")),
        _node(anomaly=("False", "NoAnomaly", "recovered")),
        _node(anomaly=("False", "NoAnomaly", ""), taints=[{"key": names.TAINT_UNHEALTHY}]),
    ]
    for node in changed:
        assert classify.node_signature(node) != classify.node_signature(base), node


def test_node_news_tells_each_problem_once_and_again_after_a_recovery():
    news = classify.NodeNewsFilter()
    ill = _node(anomaly=("True", "XidError", "xid 79"))
    first = news.read(ill)
    assert first is not None and first.problem is not None
    assert first.problem.reason == "XidError" and not first.tainted
    assert (
        news.read(_node(anomaly=("True", "XidError", "xid 79"), when="2026-01-02T00:00:00Z"))
        is None
    )
    # Our taint arrives: news (tainted), but the same problem is not told again.
    tainted = news.read(
        _node(anomaly=("True", "XidError", "xid 79"), taints=[{"key": names.TAINT_UNHEALTHY}])
    )
    assert tainted is not None and tainted.tainted and tainted.problem is None
    healthy = news.read(_node(anomaly=("False", "NoAnomaly", "")))
    assert healthy is not None and healthy.problem is None and not healthy.tainted
    again = news.read(ill)
    assert again is not None and again.problem is not None  # ill again: told again
    news.forget(ill["metadata"]["name"])  # e.g. acting on it failed: retried
    retried = news.read(ill)
    assert retried is not None and retried.problem is not None
