"""Operator settings: environment variables ``BULKHEAD_OPERATOR_*``, overridable by flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bulkhead.api.node_problems import DEFAULT_EVICT_SEVERITIES
from bulkhead.api.protocol import AGENT_PORT
from bulkhead.api.spec import Severity


class OperatorSettings(BaseSettings):
    """Everything ``bulkhead-operator`` can be configured with."""

    model_config = SettingsConfigDict(env_prefix="BULKHEAD_OPERATOR_", extra="ignore")

    namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces to watch; empty = the whole cluster (needs cluster RBAC).",
    )
    kubeconfig: str | None = Field(None, description="Kubeconfig path; default: in-cluster.")
    listen_host: str = Field("0.0.0.0", description="Address of the control endpoint.")
    listen_port: int = Field(8080, ge=0, le=65535, description="0 = any free port.")
    control_url: str | None = Field(
        None,
        description="URL workers reach the control endpoint at; default: the operator "
        "Service http://bulkhead-operator.<operator namespace>.svc:<port>.",
    )
    operator_namespace: str = Field("bulkhead-system", description="Where the operator runs.")
    image: str = Field(
        "ghcr.io/bulkhead-dev/bulkhead:0.1.0",
        description="Image of the checkpoint sidecar and of templates that name none.",
    )
    shm_size_limit: str | None = Field(
        None,
        description="sizeLimit of the shared emptyDir; default: the trainer's memory limit.",
    )
    allow_privileged_templates: bool = Field(
        False,
        description="Run jobs whose pod template uses the host's namespaces or paths, runs "
        "privileged or as root, adds capabilities or names a service account; off: such a "
        "job fails saying which field (bulkhead.operator.k8s.admission).",
    )
    agent_port: int = Field(
        AGENT_PORT, ge=1, le=65535, description="hostPort of the node agent workers report to."
    )
    agent_report_token: str | None = Field(
        None,
        description="The node agents' report token, put in each job's Secret for its workers; "
        "unset = workers report without one (agents with a token refuse them).",
    )
    agent_report_token_file: Path | None = Field(
        None,
        description="A file holding the agents' token instead (a mounted Secret key), read "
        "for each new job: a rotated token reaches new jobs without a restart.",
    )
    status_min_interval_s: float = Field(2.0, ge=0, description="Min seconds between writes.")
    stop_grace_period_s: int = Field(30, ge=0, description="Grace period of a stopped worker.")
    untaint_after_healthy_s: float = Field(
        600.0,
        ge=0,
        le=30 * 86_400,
        description=(
            "Remove our taint (and our cordon) once the node has been healthy this long; "
            "0 = never (taints stay until an admin removes them)."
        ),
    )
    evict_severities: list[Severity] = Field(
        default_factory=lambda: list(DEFAULT_EVICT_SEVERITIES),
        description="Node problem severities that may take a node out of service (cordon "
        "and taint), for every job: a job's faultTolerance.evictSeverities is narrowed to "
        "these. Problems a job causes itself (NaN loss, hang, straggler) never do.",
    )
    evict_idle_nodes: bool = Field(
        False,
        description="Also take nodes that run no worker out of service for a problem of "
        "a severity in evict_severities.",
    )
    node_event_namespace: str = Field(
        "default",
        description="Namespace of Node Events: the API server accepts Events about "
        "cluster-scoped objects only in default (or kube-system).",
    )
    kube_concurrency: int = Field(64, ge=1, description="Parallel API requests at most.")
    leader_elect: bool = Field(
        False,
        description="Run as one of several replicas: only the holder of the Lease acts and "
        "serves the control endpoint; the others wait as standbys (the chart turns it on).",
    )
    leader_election_namespace: str | None = Field(
        None, description="Namespace of the Lease; default: the operator's namespace."
    )
    leader_election_lease: str = Field("bulkhead-operator", description="Name of the Lease.")
    leader_election_identity: str | None = Field(
        None, description="This replica's name in the Lease; default: the pod's name."
    )
    pod_name: str | None = Field(
        None,
        description="This replica's pod (downward API): the leader labels it so the control "
        "Service routes workers to it alone.",
    )
    lease_duration_s: float = Field(15.0, gt=0, le=600, description="Lease duration.")
    renew_deadline_s: float = Field(
        10.0, gt=0, le=600, description="The leader steps down if it cannot renew this long."
    )
    retry_period_s: float = Field(2.0, gt=0, le=600, description="Lease renew/retry period.")
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of /livez, answered by leader and standbys alike (liveness); "
        "readiness is the control endpoint's /healthz, served by the leader only.",
    )
    log_format: str = Field("json", pattern="^(json|text)$")
    log_level: str = Field("INFO")

    def worker_control_url(self, port: int) -> str:
        if self.control_url:
            return self.control_url
        return f"http://bulkhead-operator.{self.operator_namespace}.svc:{port}"
