"""What the operator refuses to run: names its objects cannot carry, privileged templates."""

from bulkhead.api import parse_spec
from bulkhead.operator.k8s import builders
from bulkhead.operator.k8s.admission import refusals, storage_warning


def _spec(**pod_spec):
    containers = pod_spec.pop("containers", [{"name": "trainer"}])
    return parse_spec({"workers": 2, "template": {"spec": {"containers": containers, **pod_spec}}})


def test_names_the_objects_cannot_carry_are_refused_ordinary_ones_pass():
    assert refusals("llm-7b", _spec(), allow_privileged=False) == []
    for bad in ("1job", "j" * 64, "a.b", "Upper", "trailing-"):
        (why,) = refusals(bad, _spec(), allow_privileged=False)
        assert why.startswith("metadata.name") and "DNS-1035" in why, why


def test_each_privileged_field_is_named_and_the_setting_allows_them():
    spec = _spec(
        hostIPC=True,
        serviceAccount="builder",
        securityContext={"runAsNonRoot": False},
        containers=[
            {"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
            {"name": "dbg", "securityContext": {"allowPrivilegeEscalation": True}},
        ],
        initContainers=[{"name": "setup", "securityContext": {"runAsGroup": 0}}],
    )
    found = refusals("ok", spec, allow_privileged=False)
    expected = [
        "spec.template.spec.hostIPC is true",
        "spec.template.spec.serviceAccount is 'builder'",
        "spec.template.spec.securityContext.runAsNonRoot is false",
        "containers[trainer].securityContext.capabilities.add has SYS_ADMIN",
        "containers[dbg].securityContext.allowPrivilegeEscalation is true",
        "initContainers[setup].securityContext.runAsGroup is 0",
    ]
    assert len(found) == len(expected)
    for field, line in zip(expected, found, strict=True):
        assert field in line and "allowPrivilegedTemplates" in line, (field, line)
    assert refusals("ok", spec, allow_privileged=True) == []


def test_rdma_memory_pinning_and_the_default_account_are_not_privileged():
    spec = _spec(
        serviceAccountName="default",
        containers=[
            {"name": "trainer", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}
        ],
    )
    assert refusals("ok", spec, allow_privileged=False) == []


def test_every_container_of_the_pod_is_hardened():
    from test_k8s_builders import _ctx

    template = {
        "spec": {
            "containers": [{"name": "trainer"}, {"name": "logs", "image": "x"}],
            "initContainers": [{"name": "fetch", "image": "y"}],
        }
    }
    pod = builders.build_worker_pod(_ctx(template=template), "llm-w0-0", slot=0, incarnation=0)
    spec = pod["spec"]
    for container in spec["containers"] + spec["initContainers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]


def test_a_storage_path_on_no_volume_warns_one_on_a_mount_or_a_pvc_does_not():
    def spec(storage, mounts=()):
        trainer = {
            "name": "trainer",
            "volumeMounts": [{"name": "v", "mountPath": m} for m in mounts],
        }
        return parse_spec(
            {
                "workers": 2,
                "checkpoint": {"storage": storage},
                "template": {"spec": {"containers": [trainer]}},
            }
        )

    warning = storage_warning(spec({"path": "/ckpt/run1"}))
    assert warning is not None and "'/ckpt/run1' is on no volume" in warning
    assert storage_warning(spec({"path": "/ckpt/run1"}, mounts=["/ckpt"])) is None
    assert storage_warning(spec({"path": "/ckpt/run1"}, mounts=["/ck"])) is not None
    assert storage_warning(spec({"path": "/ckpt", "pvc": "claim"})) is None
    assert storage_warning(spec({})) is None
