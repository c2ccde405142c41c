"""Leader election on a ``coordination.k8s.io/v1`` Lease: exactly one operator replica acts.

Why not Kopf's peering: Kopf pauses lower-priority peers but lets peers of equal priority
run side by side (with a warning), and a paused peer still serves nothing; the operator
also serves the workers' control endpoint, which must come from the one replica that owns
the sessions. So the replica that holds the Lease runs everything (Kopf, the sessions, the
control endpoint, which makes it Ready, so the Service routes workers to it); the others
wait, not Ready, until the Lease expires, then one takes over and rebuilds every job from
the API server as after a restart.

The algorithm is the one Kubernetes components use (published in client-go's
leaderelection): a lease is free when nobody holds it or when its record has not changed
for ``lease_duration_s`` *by the candidate's own clock* (never by comparing the holder's
timestamps with ours, so clock skew cannot hand over a live lease); writes are
compare-and-swap on ``resourceVersion``; the leader renews every ``retry_period_s`` and
gives up (the process exits) if it cannot renew for ``renew_deadline_s``, which is shorter
than the lease so it stops before anyone else may start. A leader shutting down cleanly
releases the lease so the next one starts at once.

The deadline is enforced, not just noticed: the Lease has a connection of its own (the
client's ``lease`` lane) and each request a timeout of what is left of the deadline, so a
slow API server cannot hold a renewal past it; and ``is_leading`` is the client's fence,
so from the moment the deadline passes no write of this replica leaves the process, even
one already queued or retried (``NotLeading``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import httpx

from bulkhead.operator.k8s.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

LEASE_API = "/apis/coordination.k8s.io/v1"


@dataclass(frozen=True)
class ElectionSettings:
    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, "
                f"got {self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says, reduced to what the decision reads."""

    holder: str
    duration_s: float
    renew_time: str  # compared for equality only: a change means the holder is alive
    transitions: int

    @classmethod
    def of(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            duration_s=float(spec.get("leaseDurationSeconds") or 0),
            renew_time=str(spec.get("renewTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
        )


Decision = Literal["create", "renew", "take", "wait"]


def decide(
    record: LeaseRecord | None,
    identity: str,
    observed: LeaseRecord | None,
    observed_at: float,
    now: float,
) -> Decision:
    """What candidate ``identity`` does with the current lease ``record``.

    ``observed`` is the record as this candidate last saw it change and ``observed_at`` when
    (its own monotonic clock); a holder whose record has not changed for the lease's
    duration is presumed dead.
    """
    if record is None:
        return "create"
    if record.holder == identity:
        return "renew"
    if not record.holder:
        return "take"  # released by a leader that shut down
    unchanged_since = observed_at if observed == record else now
    if now - unchanged_since >= record.duration_s:
        return "take"
    return "wait"


class LeaderElector:
    """Acquires and keeps the Lease through a ``KubeClient``."""

    def __init__(self, client: KubeClient, settings: ElectionSettings) -> None:
        self.client = client
        self.settings = settings
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._last_renewal = 0.0
        self._leading = False

    def is_leading(self) -> bool:
        """Whether this replica may still act as the leader: it holds the lease and renewed
        it less than the renew deadline ago (by its own monotonic clock)."""
        elapsed = time.monotonic() - self._last_renewal
        return self._leading and elapsed < self.settings.renew_deadline_s

    def _deadline_left(self) -> float:
        """How long the next Lease request may take: what is left of the renew deadline
        while leading, the renew deadline while a candidate."""
        if not self._leading:
            return self.settings.renew_deadline_s
        return max(0.05, self.settings.renew_deadline_s - (time.monotonic() - self._last_renewal))

    @property
    def path(self) -> str:
        s = self.settings
        return f"{LEASE_API}/namespaces/{s.namespace}/leases/{s.name}"

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this replica holds the lease (True) or ``stop`` is set (False)."""
        waiting_logged = False
        while not stop.is_set():
            if await self._try():
                self._leading = True
                log.info(
                    "leader election: %s leads (lease %s/%s)",
                    self.settings.identity,
                    self.settings.namespace,
                    self.settings.name,
                )
                return True
            if not waiting_logged and self._observed is not None:
                log.info(
                    "leader election: %s is the leader; %s waits as a standby",
                    self._observed.holder or "nobody",
                    self.settings.identity,
                )
                waiting_logged = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.retry_period_s)
        return False

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until ``stop``; returns early (leadership lost) when renewals fail for the
        renew deadline or another replica took the lease."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.retry_period_s)
            if stop.is_set():
                return
            renewed = await self._try()
            if renewed:
                continue
            if self._observed is not None and self._observed.holder not in (
                "",
                self.settings.identity,
            ):
                self._leading = False
                log.error("leader election: lost the lease to %s", self._observed.holder)
                return
            if time.monotonic() - self._last_renewal >= self.settings.renew_deadline_s:
                self._leading = False
                log.error(
                    "leader election: could not renew the lease for %.0f s; stepping down",
                    self.settings.renew_deadline_s,
                )
                return

    async def release(self) -> bool:
        """Hand the lease back (clean shutdown) so a standby takes over without waiting.

        Reads the lease first: only a lease this replica still holds is released, with its
        current resourceVersion (a renewal cut short may have changed it).
        """
        try:
            self._leading = False
            lease = await self.client.get(self.path, lane="lease")
            if LeaseRecord.of(lease).holder != self.settings.identity:
                return False
            body = _with_spec(lease, holderIdentity="", leaseDurationSeconds=1)
            await self.client.request("PUT", self.path, body, lane="lease")
        except (KubeError, httpx.HTTPError, OSError) as exc:  # it expires on its own
            log.warning("leader election: could not release the lease: %s", exc)
            return False
        log.info("leader election: released the lease")
        return True

    async def _try(self) -> bool:
        """One round of the election; True when this replica holds the lease after it."""
        s = self.settings
        now = time.monotonic()
        try:
            lease: dict[str, Any] | None = await self.client.get(
                self.path, lane="lease", timeout_s=self._deadline_left()
            )
        except KubeError as exc:
            if exc.status != 404:
                log.warning("leader election: reading the lease failed: %s", exc)
                return False
            lease = None
        except (httpx.HTTPError, OSError) as exc:
            log.warning("leader election: reading the lease failed: %s", _describe(exc))
            return False
        record = LeaseRecord.of(lease) if lease is not None else None
        if record != self._observed:
            self._observed, self._observed_at = record, now
        action = decide(record, s.identity, self._observed, self._observed_at, now)
        if action == "wait":
            return False
        stamp = datetime.now(UTC).isoformat(timespec="microseconds")
        spec: dict[str, Any] = {
            "holderIdentity": s.identity,
            "leaseDurationSeconds": max(1, round(s.lease_duration_s)),
            "renewTime": stamp,
        }
        if action in ("create", "take"):
            spec["acquireTime"] = stamp
            spec["leaseTransitions"] = (record.transitions + 1) if record else 0
        try:
            if action == "create":
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": s.name, "namespace": s.namespace},
                    "spec": spec,
                }
                written = await self.client.request(
                    "POST",
                    f"{LEASE_API}/namespaces/{s.namespace}/leases",
                    body,
                    lane="lease",
                    timeout_s=self._deadline_left(),
                )
            else:
                assert lease is not None
                # resourceVersion makes this a compare-and-swap: of two candidates taking an
                # expired lease at once, one gets 409 Conflict.
                written = await self.client.request(
                    "PUT",
                    self.path,
                    _with_spec(lease, **spec),
                    lane="lease",
                    timeout_s=self._deadline_left(),
                )
        except KubeError as exc:
            if exc.status not in (409, 404):
                log.warning("leader election: writing the lease failed: %s", exc)
            return False
        except (httpx.HTTPError, OSError) as exc:
            log.warning("leader election: writing the lease failed: %s", _describe(exc))
            return False
        self._observed, self._observed_at = LeaseRecord.of(written), now
        self._last_renewal = now
        if action == "take":
            log.info(
                "leader election: took the lease from %s", record.holder if record else "nobody"
            )
        return True


def _describe(exc: BaseException) -> str:
    """The error's type and text (a timeout's text is empty)."""
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _with_spec(lease: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {**lease, "spec": {**(lease.get("spec") or {}), **spec}}


LEADER_LABEL = "bulkhead.dev/leader"


async def route_to(client: KubeClient, namespace: str, pod: str | None) -> None:
    """Make ``pod`` the only operator pod the control Service selects (``LEADER_LABEL``).

    Every replica is Ready (alive), so the Service selects the leader by this label rather
    than by readiness; a leader killed outright keeps its label, so the new leader strips
    the label from every other pod first. ``pod=None`` strips it from all (clean shutdown).
    """
    selector = f"{LEADER_LABEL}=true"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for other in await client.list(pods, label_selector=selector):
        name = other["metadata"]["name"]
        if name != pod:
            await client.merge_patch(
                f"{pods}/{name}", {"metadata": {"labels": {LEADER_LABEL: None}}}
            )
    if pod is not None:
        await client.merge_patch(f"{pods}/{pod}", {"metadata": {"labels": {LEADER_LABEL: "true"}}})
