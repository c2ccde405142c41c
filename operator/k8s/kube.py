"""A small async REST client for the Kubernetes API server (the only I/O edge to it).

Credentials come from a kubeconfig or the in-cluster service account, loaded by the
official ``kubernetes`` package; requests go through pooled ``httpx.AsyncClient``s with
bounded concurrency, so creating a thousand pods is a thousand parallel-but-bounded POSTs
and no thread per call. Bodies are plain dicts (the builders' output).

Each request names its lane, and each lane has its own connections and its own bound, so
work of one kind never waits in the queue of another:

- ``lease``: the leader's Lease alone, on its own connection, so a renewal never waits
  behind anything and can be given its own deadline (``leader``).
- ``urgent``: what a recovery waits on: cordoning and tainting a bad node (and its Event),
  recording and creating a replacement pod. A thousand routine requests in flight must
  not delay these (a bad node stayed schedulable 17 s behind the pod labels of a
  1,000-worker job, issue 42).
- ``routine``: first pod creates, deletes, status writes, Events (the ``concurrency`` bound).
- ``background``: bookkeeping nobody waits on (the generation label of every member pod):
  a few requests at a time, so it cannot crowd the API server either.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from kubernetes import config as kube_config
from kubernetes.client import Configuration
from prometheus_client import Counter, Histogram

from bulkhead.api.crd import PLURAL
from bulkhead.api.spec import API_GROUP, API_VERSION
from bulkhead.operator.metrics import REGISTRY

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"

Lane = Literal["lease", "urgent", "routine", "background"]
URGENT_CONCURRENCY = 8  # a recovery's requests: a few nodes and pods at a time
BACKGROUND_CONCURRENCY = 4

KUBE_REQUESTS = Counter(
    "bulkhead_operator_kube_requests_total",
    "Requests to the Kubernetes API server (Kopf's TrainingJob watch aside), by lane and "
    "verb; our pod and node watches count as lane watch, verb WATCH.",
    ["lane", "verb"],
    registry=REGISTRY,
)
KUBE_QUEUE_WAIT = Histogram(
    "bulkhead_operator_kube_queue_wait_seconds",
    "Time a request waited for a free slot of its lane before being sent.",
    ["lane"],
    buckets=(0.001, 0.01, 0.05, 0.2, 1, 5, 30),
    registry=REGISTRY,
)


class NotLeading(RuntimeError):
    """A write refused before it was sent: this replica no longer holds the leader's Lease.

    The fence (``KubeClient.fence``) makes a deposed leader's late writes fail in this
    process, so they cannot reach the API server after another replica may have taken
    over; retry loops treat it as final."""


class KubeError(RuntimeError):
    """A request the API server refused; ``status`` is the HTTP status code."""

    def __init__(self, status: int, method: str, path: str, message: str):
        self.status = status
        super().__init__(f"{method} {path}: {status} {message}")


@dataclass(frozen=True)
class Credentials:
    server: str
    ca_file: str | None
    verify: bool
    cert_file: str | None
    key_file: str | None
    configuration: Configuration

    def authorization(self) -> str | None:
        """The bearer header value, re-read each time so rotated tokens are picked up."""
        return self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")


def load_credentials(kubeconfig: str | Path | None = None) -> Credentials:
    """From ``kubeconfig`` if given, else in-cluster, else the default kubeconfig."""
    cfg = Configuration()
    if kubeconfig is not None:
        kube_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    else:
        try:
            kube_config.load_incluster_config(client_configuration=cfg)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=cfg)
    return Credentials(
        server=cfg.host.rstrip("/"),
        ca_file=cfg.ssl_ca_cert,
        verify=bool(cfg.verify_ssl),
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
        configuration=cfg,
    )


def tj_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


def core_path(kind: str, namespace: str | None = None, name: str = "") -> str:
    """Path of a core/v1 collection or object (``kind`` plural, e.g. "pods")."""
    base = f"/api/v1/namespaces/{namespace}/{kind}" if namespace else f"/api/v1/{kind}"
    return f"{base}/{name}" if name else base


# Connections per httpx pool. httpcore scans every connection of its pool (an expiry
# check with a socket poll each) whenever a request starts or ends: with one pool of 64,
# that scan was 38 % of the operator's CPU while a 1,000-worker job started (py-spy, issue
# 42). A lane of more connections is made of several pools of this size. With 16 requests
# in flight, a client's CPU per request: pools of 16 2.6-3.3 ms, of 4 1.8-2.2 ms, of 2
# 1.4-1.5 ms (a loaded machine; same run, alternated); 4 keeps most of the gain.
POOL_CONNECTIONS = 4


class _LanePool:
    """One lane: its own bound and its own connections (a request waiting for a slot in
    another lane's pool is exactly the queueing the lanes are there to avoid).

    A slot is a pool with a free connection: ``slots`` holds each of the lane's pools
    once per connection it has, so taking a slot picks a pool that can send at once."""

    def __init__(
        self, name: Lane, concurrency: int, make_http: Callable[[int | None], httpx.AsyncClient]
    ) -> None:
        sizes = [POOL_CONNECTIONS] * (concurrency // POOL_CONNECTIONS)
        if concurrency % POOL_CONNECTIONS:
            sizes.append(concurrency % POOL_CONNECTIONS)
        self.pools = [make_http(size) for size in sizes]
        self.slots: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
        for pool, size in zip(self.pools, sizes, strict=True):
            for _ in range(size):
                self.slots.put_nowait(pool)
        self.wait = KUBE_QUEUE_WAIT.labels(lane=name)

    async def close(self) -> None:
        for pool in self.pools:
            await pool.aclose()


class KubeClient:
    """Async JSON requests to the API server, bounded per lane (see the module docstring)."""

    def __init__(
        self, credentials: Credentials, concurrency: int = 64, timeout_s: float = 30.0
    ) -> None:
        self._creds = credentials
        verify: ssl.SSLContext | bool = False
        if credentials.verify:
            verify = ssl.create_default_context(cafile=credentials.ca_file)
            if credentials.cert_file:
                verify.load_cert_chain(credentials.cert_file, credentials.key_file)

        def make_http(connections: int | None) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=credentials.server,
                verify=verify,
                timeout=timeout_s,
                limits=httpx.Limits(
                    max_connections=connections, max_keepalive_connections=connections
                ),
            )

        self._make_http = make_http
        self._sizes: dict[Lane, int] = {
            "lease": 1,
            "urgent": URGENT_CONCURRENCY,
            "routine": concurrency,
            "background": BACKGROUND_CONCURRENCY,
        }
        self._lanes: dict[Lane, _LanePool] = {}
        # Watches hold their connection for minutes: their own pool, never a lane's slot.
        self._watch_http: httpx.AsyncClient | None = None
        # Set by an elected operator: False once it may no longer lead (see NotLeading).
        self.fence: Callable[[], bool] | None = None

    def _lane(self, lane: Lane) -> _LanePool:
        pool = self._lanes.get(lane)
        if pool is None:  # made on first use: most clients only ever use "routine"
            pool = self._lanes[lane] = _LanePool(lane, self._sizes[lane], self._make_http)
        return pool

    async def close(self) -> None:
        for pool in self._lanes.values():
            await pool.close()
        self._lanes.clear()
        if self._watch_http is not None:
            await self._watch_http.aclose()
            self._watch_http = None

    def _headers(self, accept: str = "application/json") -> dict[str, str]:
        headers = {"Accept": accept}
        auth = self._creds.authorization()
        if auth:
            headers["Authorization"] = auth
        return headers

    async def watch(
        self, path: str, params: dict[str, str], timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (``params`` carry ``watch=1`` and friends), one
        parsed JSON object each, until the server ends it after ``timeout_s``."""
        if self._watch_http is None:
            self._watch_http = self._make_http(None)  # a connection per open watch
        KUBE_REQUESTS.labels(lane="watch", verb="WATCH").inc()
        # The read deadline outlasts the server's own end of the watch: a connection that
        # goes silent (bookmarks stop too) is given up and the watch resumed.
        timeout = httpx.Timeout(10.0, read=timeout_s + 60.0)
        async with self._watch_http.stream(
            "GET", path, params=params, headers=self._headers(), timeout=timeout
        ) as response:
            if response.status_code >= 400:
                body = (await response.aread()).decode(errors="replace")
                raise KubeError(response.status_code, "WATCH", path, body[:500])
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
        lane: Lane = "routine",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """One request; ``timeout_s`` overrides the client's deadline for this one."""
        headers = self._headers(accept)
        if body is not None:
            headers["Content-Type"] = content_type
        pool = self._lane(lane)
        KUBE_REQUESTS.labels(lane=lane, verb=method).inc()
        queued = time.monotonic()
        http = await pool.slots.get()
        try:
            pool.wait.observe(time.monotonic() - queued)
            # Checked after the wait for a slot, right before sending: leadership can end
            # while a request queues.
            if self.fence is not None and method != "GET" and lane != "lease" and not self.fence():
                raise NotLeading(f"{method} {path}: refused, this replica no longer leads")
            extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
            response = await http.request(
                method, path, json=body, params=params, headers=headers, **extra
            )
        finally:
            pool.slots.put_nowait(http)
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, method, path, message)
        return response.json() if response.content else {}

    async def get(
        self,
        path: str,
        params: dict[str, str] | None = None,
        lane: Lane = "routine",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        return await self.request("GET", path, params=params, lane=lane, timeout_s=timeout_s)

    async def create(self, path: str, body: dict[str, Any], lane: Lane = "routine") -> bool:
        """POST; False (and no error) when the object already exists: create is idempotent."""
        try:
            await self.request("POST", path, body, lane=lane)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def merge_patch(
        self, path: str, patch: dict[str, Any], lane: Lane = "routine"
    ) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type=MERGE_PATCH, lane=lane)

    async def delete(self, path: str, grace_period_s: int | None = None) -> bool:
        """DELETE; False (and no error) when the object is already gone."""
        body = None if grace_period_s is None else {"gracePeriodSeconds": grace_period_s}
        try:
            await self.request("DELETE", path, body)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def list(self, path: str, label_selector: str = "") -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self.get(path, params)).get("items") or []
