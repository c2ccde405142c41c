"""The pure builders: worker pods carry the launch contract, the sidecar, and our labels."""

import json
from dataclasses import replace

from bulkhead.api import parse_spec, protocol
from bulkhead.operator.k8s import builders, names
from bulkhead.operator.k8s.builders import JobContext


def _ctx(**spec_overrides) -> JobContext:
    spec = parse_spec({"workers": 4, "minWorkers": 2, **spec_overrides})
    return JobContext(
        name="llm",
        namespace="team-a",
        uid="uid-1",
        spec=spec,
        control_url="http://bulkhead-operator.bulkhead-system.svc:8080",
        image="ghcr.io/bulkhead/bulkhead:0.1.0",
    )


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_worker_pod_injects_launch_contract_and_sidecar():
    pod = builders.build_worker_pod(_ctx(), "llm-w3-1", slot=3, incarnation=1)
    spec = pod["spec"]
    trainer = spec["containers"][0]
    assert trainer["name"] == "trainer"
    assert trainer["command"] == ["bulkhead-worker"]
    env = _env(trainer)
    assert env[protocol.ENDPOINT_ENV] == "http://bulkhead-operator.bulkhead-system.svc:8080"
    assert env[protocol.TOKEN_ENV] == {"secretKeyRef": {"name": "llm-control", "key": "token"}}
    assert env[protocol.JOB_ENV] == "team-a.llm"
    assert env[protocol.WORKER_ENV] == "llm-w3-1"
    assert env[protocol.INCARNATION_ENV] == "1"
    assert env[protocol.NODE_ENV] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env[protocol.ADVERTISE_HOST_ENV] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert json.loads(env[protocol.JOB_SPEC_ENV])["workers"] == 4
    assert env[protocol.CHECKPOINT_SOCKET_ENV].startswith(env[protocol.SHM_DIR_ENV])
    # Its first process is the launcher (one trainer process replaced in place, not the pod).
    assert env[protocol.POD_LAUNCHER_ENV] == "1"
    # The node agent, on this pod's node: $(BULKHEAD_HOST_IP) is defined before it is used.
    names_in_order = [e["name"] for e in trainer["env"]]
    host_ip = names_in_order.index(builders.HOST_IP_ENV)
    assert host_ip < names_in_order.index(protocol.AGENT_URL_ENV)
    assert env[builders.HOST_IP_ENV] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env[protocol.AGENT_URL_ENV] == "http://$(BULKHEAD_HOST_IP):9402"
    assert env[protocol.AGENT_TOKEN_ENV] == {
        "secretKeyRef": {"name": "llm-control", "key": "agent-token", "optional": True}
    }
    assert env[protocol.REPLICA_TOKEN_ENV] == {
        "secretKeyRef": {"name": "llm-control", "key": "replica-token", "optional": True}
    }

    sidecar = spec["initContainers"][-1]
    assert sidecar["name"] == "checkpoint"
    assert sidecar["command"] == ["bulkhead-checkpointd"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["ports"] == [
        {"name": "ckpt-replica", "containerPort": 29700},
        {"name": "ckpt-metrics", "containerPort": 29699},
    ]
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert sidecar_env[protocol.CHECKPOINT_METRICS_PORT_ENV] == "29699"  # what the port serves
    # The sidecar gets what bulkhead-checkpointd reads, not the trainer's launch contract.
    needed = {
        protocol.SHM_DIR_ENV,
        protocol.CHECKPOINT_SOCKET_ENV,
        protocol.TOKEN_ENV,
        protocol.REPLICA_TOKEN_ENV,
    }
    assert needed <= set(sidecar_env)
    trainers_only = {protocol.JOB_SPEC_ENV, protocol.ENDPOINT_ENV, protocol.WORKER_ENV}
    assert not trainers_only & set(sidecar_env)
    shm = next(v for v in spec["volumes"] if v["name"] == names.SHM_VOLUME)
    assert shm["emptyDir"]["medium"] == "Memory"
    for container in (trainer, sidecar):
        assert {"name": names.SHM_VOLUME, "mountPath": names.SHM_MOUNT} in container["volumeMounts"]

    assert spec["restartPolicy"] == "Never"
    term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term[0]["topologyKey"] == "kubernetes.io/hostname"
    assert term[0]["labelSelector"]["matchLabels"][names.LABEL_JOB] == "llm"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    meta = pod["metadata"]
    assert meta["name"] == "llm-w3-1" and meta["namespace"] == "team-a"
    assert meta["labels"][names.LABEL_SLOT] == "3"
    assert meta["labels"][names.LABEL_INCARNATION] == "1"
    owner = meta["ownerReferences"][0]
    assert owner["kind"] == "TrainingJob" and owner["uid"] == "uid-1" and owner["controller"]


def test_template_is_kept_but_cannot_override_contract_or_labels():
    template = {
        "metadata": {"labels": {"team": "a", names.LABEL_JOB: "other"}},
        "spec": {
            "containers": [
                {"name": "helper", "image": "busybox"},
                {
                    "name": "trainer",
                    "image": "my/trainer:1",
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                    "env": [
                        {"name": "USER_VAR", "value": "x"},
                        {"name": protocol.WORKER_ENV, "value": "spoofed"},
                    ],
                },
            ],
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {}},
        },
    }
    pod = builders.build_worker_pod(_ctx(template=template), "llm-w0-0", 0, 0)
    trainer = pod["spec"]["containers"][0]
    assert trainer["image"] == "my/trainer:1"
    assert trainer["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    env = _env(trainer)
    assert env["USER_VAR"] == "x" and env[protocol.WORKER_ENV] == "llm-w0-0"
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer", "helper"]
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"][names.LABEL_JOB] == "llm"
    assert pod["spec"]["affinity"] == {"nodeAffinity": {}}  # the user's own affinity wins
    assert {"key": "dedicated", "operator": "Exists"} in pod["spec"]["tolerations"]
    # The template in the spec is not mutated by building pods from it.
    assert "volumeMounts" not in template["spec"]["containers"][1]


def test_building_is_deterministic():
    ctx = _ctx()
    assert builders.build_worker_pod(ctx, "llm-w1-0", 1, 0) == builders.build_worker_pod(
        ctx, "llm-w1-0", 1, 0
    )


def test_pvc_storage_is_mounted_in_both_containers():
    ctx = _ctx(checkpoint={"storage": {"pvc": "ckpt", "path": "/ckpt"}})
    spec = builders.build_worker_pod(ctx, "llm-w0-0", 0, 0)["spec"]
    claim = next(v for v in spec["volumes"] if v["name"] == names.CHECKPOINT_VOLUME)
    assert claim["persistentVolumeClaim"]["claimName"] == "ckpt"
    for container in (spec["containers"][0], spec["initContainers"][-1]):
        assert {"name": names.CHECKPOINT_VOLUME, "mountPath": "/ckpt"} in container["volumeMounts"]


def test_service_and_secret():
    ctx = _ctx()
    service = builders.build_service(ctx)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == names.job_selector("llm")
    secret = builders.build_secret(ctx, "s3cret", "r3plica")
    assert secret["metadata"]["name"] == "llm-control"
    assert secret["stringData"] == {"token": "s3cret", "replica-token": "r3plica"}
    members = builders.build_member_secret(ctx, "k3y")
    assert members["metadata"]["name"] == "llm-members"
    assert members["stringData"] == {"member-key": "k3y"}
    # With the agents' token configured, workers get their job's own report token (never
    # the agents' token itself) from the same Secret.
    with_agent = replace(ctx, agent_report_token="agent-t0ken", agent_port=9500)
    job_token = protocol.job_report_token("agent-t0ken", names.job_key(ctx.namespace, "llm"))
    assert builders.build_secret(with_agent, "s3cret", "r3plica")["stringData"] == {
        "token": "s3cret",
        "replica-token": "r3plica",
        "agent-token": job_token,
    }
    assert job_token != protocol.job_report_token("agent-t0ken", "other-namespace.llm")
    pod = builders.build_worker_pod(with_agent, "llm-w0-0", slot=0, incarnation=0)
    # The member key signs the workers' credentials: no pod may read it.
    assert names.member_secret_name("llm") not in json.dumps(pod)
    assert _env(pod["spec"]["containers"][0])[protocol.AGENT_URL_ENV].endswith(":9500")
    for obj in (service, secret, members):
        assert obj["metadata"]["ownerReferences"][0]["name"] == "llm"


def test_worker_pods_run_with_least_privilege():
    pod = builders.build_worker_pod(_ctx(), "llm-w0-0", slot=0, incarnation=0)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    tmp = next(v for v in spec["volumes"] if v["name"] == names.TMP_VOLUME)
    assert tmp == {"name": names.TMP_VOLUME, "emptyDir": {}}
    for container in [*spec["containers"], *spec["initContainers"]]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert {"name": names.TMP_VOLUME, "mountPath": "/tmp"} in container["volumeMounts"]
        assert _env(container)["HOME"] == "/tmp"
    # A template's own choices are kept; what it leaves out is filled in.
    own = {"containers": [{"name": "trainer", "securityContext": {"runAsUser": 2000}}],
           "securityContext": {"runAsUser": 2000}}  # fmt: skip
    custom = builders.build_worker_pod(_ctx(template={"spec": own}), "llm-w0-0", 0, 0)
    trainer = custom["spec"]["containers"][0]
    assert trainer["securityContext"]["runAsUser"] == 2000
    assert trainer["securityContext"]["readOnlyRootFilesystem"] is True
    assert custom["spec"]["securityContext"]["runAsUser"] == 2000


def test_a_pod_of_eight_gpus_runs_eight_processes_each_with_its_sidecar_port():
    template = {
        "spec": {
            "containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 8}}}]
        }
    }
    ctx = _ctx(template=template)
    assert ctx.spec.trainer_processes == 8  # one trainer process per GPU, by default
    pod = builders.build_worker_pod(ctx, "llm-w0-0", slot=0, incarnation=0)
    trainer = pod["spec"]["containers"][0]
    sidecar = pod["spec"]["initContainers"][-1]
    # Each process's socket is in its rank's directory: the launcher and sidecar agree.
    assert protocol.CHECKPOINT_SOCKET_ENV not in _env(trainer)
    assert _env(sidecar)[protocol.CHECKPOINT_LOCAL_RANKS_ENV] == "8"
    replica_ports = [p["containerPort"] for p in sidecar["ports"] if "replica" in p["name"]]
    assert replica_ports == list(range(29700, 29708))
    assert len({p["name"] for p in sidecar["ports"]}) == len(sidecar["ports"])


def test_the_sidecar_and_the_shared_memory_volume_are_always_bounded():
    """Without a trainer memory limit: the defaults; with one, both follow it; the
    operator's shm setting wins for the volume."""
    pod = builders.build_worker_pod(_ctx(), "llm-w0-0", slot=0, incarnation=0)
    sidecar = pod["spec"]["initContainers"][-1]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == names.SHM_VOLUME)
    assert sidecar["resources"]["limits"] == {"memory": builders.SIDECAR_MEMORY_LIMIT}
    assert sidecar["resources"]["requests"] == builders.SIDECAR_REQUESTS
    assert shm["emptyDir"]["sizeLimit"] == builders.SIDECAR_MEMORY_LIMIT
    template = {
        "spec": {"containers": [{"name": "trainer", "resources": {"limits": {"memory": "40Gi"}}}]}
    }
    pod = builders.build_worker_pod(_ctx(template=template), "llm-w0-0", slot=0, incarnation=0)
    sidecar = pod["spec"]["initContainers"][-1]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == names.SHM_VOLUME)
    assert sidecar["resources"]["limits"] == {"memory": "40Gi"}
    assert shm["emptyDir"]["sizeLimit"] == "40Gi"
    ctx = replace(_ctx(template=template), shm_size_limit="100Gi")
    pod = builders.build_worker_pod(ctx, "llm-w0-0", slot=0, incarnation=0)
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == names.SHM_VOLUME)
    assert shm["emptyDir"]["sizeLimit"] == "100Gi"


def test_the_workers_spec_leaves_out_the_pod_template_but_keeps_its_gpu_count():
    gpus = {"limits": {"nvidia.com/gpu": 4}}
    template = {
        "spec": {
            "containers": [{"name": "trainer", "image": "x", "resources": gpus}],
            "volumes": [{"name": "data", "emptyDir": {}}],
        }
    }
    ctx = _ctx(template=template)
    pod = builders.build_worker_pod(ctx, "llm-w0-0", slot=0, incarnation=0)
    wire = json.loads(_env(pod["spec"]["containers"][0])[protocol.JOB_SPEC_ENV])
    assert "template" not in wire  # the pod is the template: not repeated in its env
    seen_by_worker = parse_spec(wire)
    assert seen_by_worker.trainer_processes == ctx.spec.trainer_processes == 4
    assert seen_by_worker.model_dump(exclude={"template", "processes_per_worker"}) == (
        ctx.spec.model_dump(exclude={"template", "processes_per_worker"})
    )
