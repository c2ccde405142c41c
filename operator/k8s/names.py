"""Names the operator puts on Kubernetes objects: labels, annotations, taints, finalizer.

Everything the operator writes into the cluster is namespaced under ``bulkhead.dev`` so an
admin can tell (and select) what bulkhead owns.
"""

from __future__ import annotations

from bulkhead.api import protocol
from bulkhead.api.spec import API_GROUP, API_VERSION, KIND
from bulkhead.api.spec import TRAINER_CONTAINER as TRAINER_CONTAINER  # the spec counts its GPUs

PREFIX = API_GROUP  # annotation / label / taint prefix: bulkhead.dev
FINALIZER = f"{PREFIX}/finalizer"

LABEL_JOB = f"{PREFIX}/job"
LABEL_SLOT = f"{PREFIX}/slot"
LABEL_INCARNATION = f"{PREFIX}/incarnation"
LABEL_GENERATION = f"{PREFIX}/generation"  # the membership generation the pod trains in
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
MANAGED_BY = "bulkhead-operator"
WORKER_COMPONENT = "worker"

# Set on a node the operator cordoned, so it only ever uncordons nodes it cordoned itself.
ANNOTATION_CORDONED = f"{PREFIX}/cordoned-by-operator"
ANNOTATION_UNHEALTHY_SINCE = f"{PREFIX}/unhealthy-since"

# On a TrainingJob: the newest incarnation started per slot, {"slot": incarnation}. Pods of
# stopped workers are deleted, so after a restart this is the only trace that an incarnation
# was used; worker ids must never be reused.
ANNOTATION_INCARNATIONS = f"{PREFIX}/incarnations"

TAINT_UNHEALTHY = f"{PREFIX}/unhealthy"

TJ_API_VERSION = f"{API_GROUP}/{API_VERSION}"
TJ_KIND = KIND

CHECKPOINT_CONTAINER = "checkpoint"
SHM_VOLUME = "bulkhead-shm"
SHM_MOUNT = "/bulkhead/shm"
CHECKPOINT_SOCKET = f"{SHM_MOUNT}/checkpointd.sock"
CHECKPOINT_VOLUME = "bulkhead-checkpoints"
TMP_VOLUME = "bulkhead-tmp"  # the writable /tmp of a read-only root filesystem
TMP_MOUNT = "/tmp"
RUN_AS_USER = 10001  # the image's user (Dockerfile)
CHECKPOINT_MOUNT = protocol.CHECKPOINT_PVC_MOUNT
TOKEN_KEY = "token"
MEMBER_KEY_KEY = "member-key"
AGENT_TOKEN_KEY = "agent-token"
REPLICA_TOKEN_KEY = "replica-token"  # kept when the job token is rotated


def secret_name(job: str) -> str:
    """The Secret holding a job's control token."""
    return f"{job}-control"


def member_secret_name(job: str) -> str:
    """The Secret holding the key of a job's member credentials (``session.credentials``):
    the operator's alone, referenced by no pod."""
    return f"{job}-members"


def service_name(job: str) -> str:
    """The job's headless Service (pod DNS: <worker>.<job>.<namespace>.svc)."""
    return job


def job_key(namespace: str, job: str) -> str:
    """The job name on the control protocol: namespaced jobs are ``namespace.name``."""
    return f"{namespace}.{job}"


def job_selector(job: str) -> dict[str, str]:
    """Labels that select every worker pod of a job."""
    return {LABEL_JOB: job, LABEL_COMPONENT: WORKER_COMPONENT}


def all_workers_selector() -> dict[str, str]:
    """Labels that select the worker pods of every job this operator manages."""
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_COMPONENT: WORKER_COMPONENT}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
