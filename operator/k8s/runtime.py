"""The operator's state in one process: a job session per TrainingJob, fed by the cluster.

Kopf handlers (``handlers``) call into this class; it owns the sessions, their drivers and
an index of which worker runs on which node, and it turns pod and node objects into the
session's observations. On (re)start it rebuilds each job from its status and the pods that
exist, so killing the operator at any moment loses nothing.

Why this class keeps its own state instead of Kopf's daemons, indexes and timers:

- The per-job session map (``jobs``) instead of a Kopf daemon per TrainingJob: a session is
  also reached from outside Kopf (the control endpoint serves the workers through the same
  ``SessionRegistry`` as local mode), and local mode runs the same ``JobSession`` without
  Kopf at all. A daemon is cancelled and restarted by Kopf's handler machinery (on stop,
  on error with backoff); a session must instead stop without touching pods, and must never
  restart half-way through a recovery. A plain dict keyed by job keeps that in our hands.
- The pod -> node index (``_pod_node``) instead of a Kopf index: it is fed by the same pod
  events that feed the sessions and by the pod list each job start reads, so "which jobs
  run on this node" always agrees with what the sessions were told, whatever order Kopf
  runs handlers in; it is also plain data the unit tests can drive without Kopf.
- The untaint loop instead of a Kopf timer on nodes: only the few nodes we tainted need a
  re-check, at one interval derived from ``--untaint-after-healthy-seconds``; one loop over
  ``_tainted`` does that, where a timer would run for every node the operator watches.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from bulkhead.api.manifest import ManifestError, parse_spec
from bulkhead.api.node_problems import may_evict, narrow_evictions, rfc3339
from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.driver import Observe
from bulkhead.operator.k8s import builders, classify, names
from bulkhead.operator.k8s.admission import refusals, storage_warning
from bulkhead.operator.k8s.adopt import (
    decode_secret_value,
    incarnations_of,
)
from bulkhead.operator.k8s.builders import JobContext
from bulkhead.operator.k8s.driver import KubernetesDriver, live_pods
from bulkhead.operator.k8s.kube import KubeClient, KubeError, core_path
from bulkhead.operator.k8s.metrics import RECONCILE_ERRORS
from bulkhead.operator.k8s.nodes import NodeActions
from bulkhead.operator.k8s.settings import OperatorSettings
from bulkhead.operator.k8s.status_writer import StatusWriter
from bulkhead.operator.k8s.watch import CollectionWatch
from bulkhead.operator.lifecycle.types import NodeAnomaly, WorkerExited, WorkerRunning
from bulkhead.operator.metrics import EVICTIONS
from bulkhead.operator.session.job import JobSession, SessionRegistry, open_new, open_resumed
from bulkhead.operator.session.status import invalid_spec_status

log = logging.getLogger(__name__)

JobId = tuple[str, str]  # (namespace, name)


@dataclass
class JobHandle:
    ctx: JobContext
    session: JobSession[KubernetesDriver]
    reported: dict[str, tuple[str, str]] = field(default_factory=dict)
    """pod -> (state, node) last told to the session, so repeated events are not re-told."""

    @property
    def driver(self) -> KubernetesDriver:
        return self.session.driver


class OperatorRuntime:
    def __init__(
        self,
        client: KubeClient,
        settings: OperatorSettings,
        registry: SessionRegistry,
        control_url: str,
    ) -> None:
        self.client = client
        self.settings = settings
        self.registry = registry
        self.control_url = control_url
        self.nodes = NodeActions(client, settings.node_event_namespace)
        self.jobs: dict[JobId, JobHandle] = {}
        self._job_locks: dict[JobId, asyncio.Lock] = {}
        self._pod_node: dict[tuple[str, str], tuple[JobId, str]] = {}  # pod -> (job, node)
        self._node_news = classify.NodeNewsFilter()
        self._tainted: set[str] = set()  # nodes carrying our taint, for the untaint policy

    def _lock(self, job: JobId) -> asyncio.Lock:
        return self._job_locks.setdefault(job, asyncio.Lock())

    # ------------------------------------------------------------------ jobs

    async def ensure_job(self, body: dict[str, Any]) -> None:
        """Create or adopt everything of a job and run its session. Idempotent."""
        meta = body["metadata"]
        job: JobId = (meta["namespace"], meta["name"])
        async with self._lock(job):
            if job in self.jobs:
                return
            try:
                await self._start_job(body)
            except Exception:
                RECONCILE_ERRORS.labels(handler="ensure_job").inc()
                raise

    async def _start_job(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            asked = parse_spec(body.get("spec"), source=f"{namespace}/{name}")
            errors = "; ".join(refusals(name, asked, self.settings.allow_privileged_templates))
        except ManifestError as exc:
            errors = "; ".join(str(e) for e in exc.errors)
        if not errors and (warning := storage_warning(asked)) is not None:
            log.warning("job %s/%s: %s", namespace, name, warning)
        if errors:  # Failed once, with the reason: never retried until the spec changes
            log.warning("job %s/%s has an invalid spec: %s", namespace, name, errors)
            status = invalid_spec_status(errors, datetime.now(UTC))
            await StatusWriter(self.client, namespace, name).write_now(status)
            return
        spec, refused = narrow_evictions(asked, self.settings.evict_severities)
        status = self._persisted_status(body.get("status"))
        if status is not None and status.phase in ("Succeeded", "Failed"):
            log.info("job %s/%s is %s; nothing to run", namespace, name, status.phase)
            return
        ctx = JobContext(
            name=name,
            namespace=namespace,
            uid=meta["uid"],
            spec=spec,
            control_url=self.control_url,
            image=self.settings.image,
            shm_size_limit=self.settings.shm_size_limit,
            agent_port=self.settings.agent_port,
            agent_report_token=self._agents_token(),
        )
        token = await self._ensure_secret(
            ctx,
            names.secret_name(name),
            names.TOKEN_KEY,
            lambda v: builders.build_secret(ctx, v, secrets.token_urlsafe(32)),
        )
        member_key = await self._ensure_secret(
            ctx,
            names.member_secret_name(name),
            names.MEMBER_KEY_KEY,
            lambda v: builders.build_member_secret(ctx, v),
        )
        await self.client.create(core_path("services", namespace), builders.build_service(ctx))
        incarnations = incarnations_of(meta)
        pods = await live_pods(self.client, ctx)
        live = {
            p["metadata"]["name"]: obs.node
            for p in pods
            if (obs := classify.classify_pod(p)).state in ("pending", "running")
        }
        key = names.job_key(namespace, name)
        # Incarnations started by a previous operator whose pods are gone are never reused.
        # Every worker pod runs the launcher (builders.py): a whole-job restart keeps them.
        if status is None:
            opening = open_new(key, spec, pods_launch=True)
        else:
            opening = open_resumed(
                key, spec, status, live, started_incarnations=incarnations, pods_launch=True
            )

        def make_driver(observe: Observe) -> KubernetesDriver:
            return KubernetesDriver(
                self.client,
                ctx,
                self.nodes,
                observe,
                status_min_interval_s=self.settings.status_min_interval_s,
                stop_grace_period_s=self.settings.stop_grace_period_s,
                incarnations=incarnations,
            )

        token_path = core_path("secrets", namespace, names.secret_name(name))

        async def read_token() -> str:  # a rotated token is picked up (JobTokens)
            return decode_secret_value(await self.client.get(token_path), names.TOKEN_KEY)

        session = JobSession(
            opening,
            token,
            make_driver,
            namespace=namespace,
            member_key=member_key,
            valid_since=rfc3339(datetime.now(UTC)),
            token_source=read_token,
        )
        handle = JobHandle(ctx, session)
        self.jobs[(namespace, name)] = handle
        self.registry.add(session)
        await session.start()
        if refused:
            await handle.driver.record_event(
                "EvictSeveritiesNarrowed",
                f"faultTolerance.evictSeverities asks for {', '.join(refused)}, which this "
                "cluster does not let a job evict nodes for; evicting for "
                f"{', '.join(spec.fault_tolerance.evict_severities) or 'nothing'} only",
                warning=True,
            )
        for pod in pods:
            self._remember_node(namespace, pod)
            await self._tell(handle, pod, deleted=False)
        log.info(
            "job %s/%s %s with %d live pods",
            namespace,
            name,
            "resumed" if status is not None else "started",
            len(live),
        )

    @staticmethod
    def _persisted_status(raw: dict[str, Any] | None) -> TrainingJobStatus | None:
        """The status to resume from; None for a job that never started (or was invalid)."""
        if not raw:
            return None
        try:
            status = TrainingJobStatus.model_validate(raw)
        except ValueError:
            log.warning("ignoring unreadable status %s", raw)
            return None
        if any(c.type == "Valid" and c.status == "False" for c in status.conditions):
            return None
        return status

    def _agents_token(self) -> str | None:
        """The agents' token now: its file (rotated in place by the kubelet) or the setting."""
        path = self.settings.agent_report_token_file
        if path is None:
            return self.settings.agent_report_token
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            log.warning("cannot read the agents' token file %s: %s", path, exc)
            return None

    async def _ensure_secret(
        self, ctx: JobContext, name: str, key: str, build: Callable[[str], dict[str, Any]]
    ) -> str:
        """The value under ``key`` of the job's Secret ``name``: read, or (first start) a
        new random value in a Secret made by ``build``."""
        path = core_path("secrets", ctx.namespace, name)
        for _ in range(3):
            try:
                return decode_secret_value(await self.client.get(path), key)
            except KubeError as exc:
                if exc.status != 404:
                    raise
            value = secrets.token_urlsafe(32)
            if await self.client.create(core_path("secrets", ctx.namespace), build(value)):
                return value
        raise RuntimeError(f"cannot read or create Secret {path}")

    async def spec_changed(self, body: dict[str, Any]) -> None:
        """A running job's spec is fixed; an invalid one may be corrected and then starts."""
        meta = body["metadata"]
        job: JobId = (meta["namespace"], meta["name"])
        if job in self.jobs:
            await self.jobs[job].driver.record_event(
                "SpecChangeIgnored",
                "The spec of a started job cannot change; delete and re-create the job.",
                warning=True,
            )
            return
        await self.ensure_job(body)

    async def delete_job(self, namespace: str, name: str) -> None:
        """Stop the session and remove the worker pods (owner references remove the rest)."""
        async with self._lock((namespace, name)):
            handle = self.jobs.pop((namespace, name), None)
            if handle is None:
                return
            self.registry.remove(names.job_key(namespace, name))
            await handle.session.stop()
            await handle.driver.close(flush=False)
            await handle.driver.delete_all_pods()
            log.info("job %s/%s deleted; session stopped, pods removed", namespace, name)

    async def shutdown(self) -> None:
        """Stop all sessions without touching pods: a restarted operator adopts them."""
        for (namespace, name), handle in list(self.jobs.items()):
            self.registry.remove(names.job_key(namespace, name))
            await handle.session.stop()
            await handle.driver.close(flush=True)
        self.jobs.clear()

    # ------------------------------------------------------------------ feeds

    def feeds(self) -> list[CollectionWatch]:
        """The watches that feed this runtime: worker pods (per watched namespace, or the
        whole cluster) and nodes."""
        workers = names.selector_string(names.all_workers_selector())
        pod_paths = [core_path("pods", ns) for ns in self.settings.namespaces] or [
            core_path("pods")
        ]
        pods = [
            CollectionWatch(
                self.client, path, self.on_pod_event, label_selector=workers, name=f"pods {path}"
            )
            for path in pod_paths
        ]
        return [*pods, CollectionWatch(self.client, core_path("nodes"), self.on_node_change)]

    # ------------------------------------------------------------------ pods

    def _remember_node(self, namespace: str, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        meta = pod["metadata"]
        if node:
            job = (namespace, (meta.get("labels") or {}).get(names.LABEL_JOB, ""))
            self._pod_node[(namespace, meta["name"])] = (job, node)

    async def _tell(self, handle: JobHandle, pod: dict[str, Any], deleted: bool) -> None:
        """Tell the session what a pod shows, once per change."""
        worker = pod["metadata"]["name"]
        seen = classify.classify_pod(pod, deleted=deleted)
        handle.session.note_scheduling(
            worker, None if deleted else classify.unschedulable_message(pod)
        )
        if seen.state == "pending" or handle.reported.get(worker, ("", ""))[0] == "exited":
            return
        if handle.reported.get(worker) == (seen.state, seen.node):
            return
        handle.reported[worker] = (seen.state, seen.node)
        if seen.state == "running":
            handle.session.observe(WorkerRunning(worker, seen.node))
        else:
            handle.session.observe(WorkerExited(worker, seen.exit_code, seen.signal, seen.reason))

    async def on_pod_event(self, event_type: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        namespace = meta.get("namespace", "")
        job = (namespace, (meta.get("labels") or {}).get(names.LABEL_JOB, ""))
        deleted = event_type == "DELETED"
        if deleted:
            self._pod_node.pop((namespace, meta.get("name", "")), None)
        else:
            self._remember_node(namespace, pod)
        handle = self.jobs.get(job)
        if handle is None:
            return  # not started yet: the start lists the pods itself
        try:
            await self._tell(handle, pod, deleted)
        except Exception:
            RECONCILE_ERRORS.labels(handler="pod").inc()
            raise

    # ------------------------------------------------------------------ nodes

    def _jobs_on(self, node: str) -> set[JobId]:
        return {job for job, where in self._pod_node.values() if where == node and job in self.jobs}

    async def on_node_change(self, event_type: str, node: dict[str, Any]) -> None:
        if event_type == "DELETED":
            self.node_deleted(node["metadata"]["name"])
        else:
            await self.on_node_event(node)

    async def on_node_event(self, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        news = self._node_news.read(node)
        if news is None:
            return
        if news.tainted:
            self._tainted.add(name)
        else:
            self._tainted.discard(name)
        if news.problem is None:
            return
        top = news.problem
        jobs = self._jobs_on(name)
        log.warning(
            "node %s: %s (%s) %s; jobs on it: %s",
            name,
            top.reason,
            top.severity,
            top.message,
            sorted(f"{ns}/{n}" for ns, n in jobs) or "none",
        )
        try:
            for job in jobs:
                self.jobs[job].session.observe(NodeAnomaly(name, top.reason, top.severity))
            idle_eviction = not jobs and self.settings.evict_idle_nodes
            allowed = self.settings.evict_severities
            if (
                idle_eviction
                and may_evict(top.reason, top.severity, allowed)
                and await self.nodes.evict(name, top.reason)
            ):
                EVICTIONS.labels(reason=top.reason).inc()
        except Exception:
            RECONCILE_ERRORS.labels(handler="node").inc()
            self._node_news.forget(name)  # retried on the next event
            raise

    def node_deleted(self, name: str) -> None:
        """Forget a deleted node (a new node of that name starts afresh)."""
        self._node_news.forget(name)

    async def untaint_loop(self) -> None:
        """The optional untaint policy (see ``nodes``): a healthy node sends no more events,
        so tainted nodes are re-checked on a timer."""
        after = self.settings.untaint_after_healthy_s
        if after <= 0:
            return
        every = max(1.0, min(30.0, after / 4))
        while True:
            await asyncio.sleep(every)
            for name in sorted(self._tainted):
                try:
                    if await self.nodes.maybe_untaint(name, after):
                        self._tainted.discard(name)
                except KubeError as exc:
                    if exc.status == 404:
                        self._tainted.discard(name)
                    else:
                        log.warning("untaint check of node %s failed: %s", name, exc)
