"""The Kopf settings: the slim diff base gives Kopf the very essence its own storage builds."""

import copy

import kopf

from bulkhead.operator.k8s import names
from bulkhead.operator.k8s.handlers import SlimDiffBase

TJ = {
    "apiVersion": "bulkhead.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {
        "name": "j",
        "namespace": "ns",
        "uid": "u",
        "resourceVersion": "9",
        "labels": {"team": "a"},
        "annotations": {
            f"{names.PREFIX}/last-handled-configuration": '{"spec":{}}',
            "kubectl.kubernetes.io/last-applied-configuration": "{}",
            "note": "kept",
        },
        "managedFields": [{"manager": "kubectl"}],
        "finalizers": [names.FINALIZER],
    },
    "spec": {"workers": 3, "template": {"spec": {"containers": [{"name": "trainer"}]}}},
    "status": {
        "phase": "Running",
        "membership": {"members": [{"worker": f"w{i}"} for i in range(9)]},
    },
}


def test_slim_diff_base_builds_kopfs_essence():
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=names.PREFIX)
    slim = SlimDiffBase(prefix=names.PREFIX)
    for extra in (set(), {("spec",)}, {("metadata", "labels", "team")}, {("status", "phase")}):
        body = kopf.Body(copy.deepcopy(TJ))
        assert slim.build(body=body, extra_fields=extra) == kopfs.build(
            body=body, extra_fields=extra
        ), extra
    essence = slim.build(body=kopf.Body(copy.deepcopy(TJ)), extra_fields={("spec",)})
    assert "status" not in essence and essence["metadata"] == {
        "labels": {"team": "a"},
        "annotations": {"note": "kept"},
    }
