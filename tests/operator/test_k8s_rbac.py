"""The operator's RBAC in deploy/ on a real API server: what it needs, and nothing else."""

from __future__ import annotations

import pytest
from k8s_operator_harness import OperatorRbac, ensure_crd

pytestmark = [pytest.mark.k8s]

NEEDED_IN_NAMESPACE = [
    ("create", "pods"),
    ("delete", "pods"),
    ("watch", "pods"),
    ("create", "services"),
    ("get", "secrets"),
    ("create", "secrets"),
    ("create", "events"),
    ("watch", "trainingjobs.bulkhead.dev"),
    ("patch", "trainingjobs.bulkhead.dev"),
    ("patch", "trainingjobs.bulkhead.dev/status"),
    ("update", "trainingjobs.bulkhead.dev/finalizers"),
    # Leader election, in the operator's own namespace (here the same as the job's).
    ("get", "leases.coordination.k8s.io"),
    ("create", "leases.coordination.k8s.io"),
    ("update", "leases.coordination.k8s.io"),
    ("patch", "pods"),  # the leader's label, which the control Service selects
]
NEEDED_CLUSTER = [("watch", "nodes"), ("patch", "nodes"), ("create", "events")]  # Node Events
DENIED_IN_NAMESPACE = [
    ("list", "secrets"),  # only its own tokens, by name
    ("watch", "secrets"),
    ("delete", "secrets"),
    ("update", "pods"),
    ("create", "pods/exec"),
    ("get", "configmaps"),
    ("create", "deployments.apps"),
    ("delete", "services"),
    ("create", "trainingjobs.bulkhead.dev"),
    ("delete", "trainingjobs.bulkhead.dev"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
]
DENIED_CLUSTER = [
    ("delete", "nodes"),
    ("create", "nodes"),
    ("update", "nodes/status"),
    ("delete", "namespaces"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("patch", "customresourcedefinitions.apiextensions.k8s.io"),
    # Outside the namespaces it watches the operator neither elects, relabels nor runs pods,
    # and reads no Secret.
    ("update", "leases.coordination.k8s.io"),
    ("patch", "pods"),
    ("create", "pods"),
    ("get", "secrets"),
    ("watch", "trainingjobs.bulkhead.dev"),
]


def test_operator_rbac_is_least_privilege(k8s_cluster, k8s_namespace):
    ensure_crd(k8s_cluster)
    rbac = OperatorRbac(k8s_cluster, k8s_namespace)
    try:
        rbac.apply()
        missing = [f"{v} {r}" for v, r in NEEDED_IN_NAMESPACE if not rbac.can(v, r, k8s_namespace)]
        missing += [f"{v} {r}" for v, r in NEEDED_CLUSTER if not rbac.can(v, r)]
        extra = [f"{v} {r}" for v, r in DENIED_IN_NAMESPACE if rbac.can(v, r, k8s_namespace)]
        extra += [f"{v} {r}" for v, r in DENIED_CLUSTER if rbac.can(v, r)]
        assert not missing, f"the operator lacks rights it needs: {missing}"
        assert not extra, f"the operator has rights it does not need: {extra}"
    finally:
        rbac.delete()
