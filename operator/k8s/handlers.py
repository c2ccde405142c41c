"""Kopf handlers: thin adapters from TrainingJob events to ``OperatorRuntime`` calls.

Worker pods and nodes are not Kopf's: they reach the runtime through our own watches
(``watch``), which cost a fraction of Kopf's per-event work at a thousand pods.

The handlers live in their own ``kopf.OperatorRegistry`` (not Kopf's global one), so an
operator can be started and stopped in-process, e.g. by tests, without leftovers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import kopf

from bulkhead.api.crd import PLURAL
from bulkhead.api.spec import API_GROUP, API_VERSION
from bulkhead.operator.k8s import names
from bulkhead.operator.k8s.kube import Credentials
from bulkhead.operator.k8s.runtime import OperatorRuntime

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = 2.0
_TJ = (API_GROUP, API_VERSION, PLURAL)


class SlimDiffBase(kopf.AnnotationsDiffBaseStorage):
    """Kopf's diff base (what a change handler compares: spec, labels, annotations) built
    without copying what it then throws away.

    Kopf computes it for every event of every watched object, handlers or not, by deep-
    copying the whole body and then dropping its status and metadata: a TrainingJob's
    status lists every member (1,000 at 1,000 workers) and a node's lists its images, so
    each status write and each node heartbeat cost a deep copy of all that for nothing.
    The same essence, from a body that never had those parts.
    """

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        extra = list(extra_fields or [])
        if not all(_kept(field) for field in extra):  # e.g. a handler on a status field
            return super().build(body=body, extra_fields=extra)
        meta = body.get("metadata") or {}
        slim = {k: v for k, v in body.items() if k not in ("status", "metadata")}
        slim["metadata"] = {k: meta[k] for k in _KEPT_METADATA if k in meta}
        return super().build(body=kopf.Body(slim), extra_fields=extra)


_KEPT_METADATA = ("labels", "annotations")


def _kept(field: Any) -> bool:
    """Whether the slim body has ``field`` (a Kopf field path: a tuple or a dotted string)."""
    path = field.split(".") if isinstance(field, str) else list(field)
    if not path or path[0] == "status":
        return False
    return path[0] != "metadata" or (len(path) > 1 and path[1] in _KEPT_METADATA)


def kopf_settings() -> kopf.OperatorSettings:
    """Kopf's bookkeeping under our own prefix: finalizer, progress and diff-base annotations."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = SlimDiffBase(prefix=names.PREFIX)
    # Our own Events say what happened; Kopf's per-handler "succeeded" Events are noise.
    settings.posting.level = logging.WARNING
    # Fixed namespaces, no CRD/namespace discovery: fewer RBAC rights needed.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    return settings


def build_registry(runtime: OperatorRuntime, credentials: Credentials) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry, id="login")
    def login(**_: Any) -> kopf.ConnectionInfo:
        auth = credentials.authorization()
        scheme, _, token = (auth or "").partition(" ")
        return kopf.ConnectionInfo(
            server=credentials.server,
            ca_path=credentials.ca_file,
            insecure=not credentials.verify,
            scheme=scheme or None,
            token=token or None,
            certificate_path=credentials.cert_file,
            private_key_path=credentials.key_file,
        )

    # Explicit ids: Kopf keeps per-handler progress in annotations named after them.
    @kopf.on.resume(*_TJ, registry=registry, backoff=RETRY_BACKOFF_S, id="job-present")
    @kopf.on.create(*_TJ, registry=registry, backoff=RETRY_BACKOFF_S, id="job-present")
    async def job_present(body: kopf.Body, **_: Any) -> None:
        await runtime.ensure_job(dict(body))

    @kopf.on.update(*_TJ, field="spec", registry=registry, backoff=RETRY_BACKOFF_S, id="spec")
    async def job_spec_changed(body: kopf.Body, **_: Any) -> None:
        await runtime.spec_changed(dict(body))

    @kopf.on.delete(*_TJ, registry=registry, backoff=RETRY_BACKOFF_S, id="job-deleted")
    async def job_deleted(namespace: str, name: str, **_: Any) -> None:
        await runtime.delete_job(namespace, name)

    return registry
