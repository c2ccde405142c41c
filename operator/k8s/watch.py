"""The operator's pod and node feeds: list, then watch, one collection on our own connection.

Kopf keeps the TrainingJobs (finalizers, create/update/delete causes, retries). Worker pods
and nodes are the high-volume streams (a 1,000-worker job means 1,000 pods with four or
five events each, and every node of the cluster sends heartbeats), and for them Kopf's
per-event machinery (a worker task per object, the diff base, progress storage, handler
selection) cost more than everything else the operator does: in the 1,000-node bench it
was most of the operator's 25 CPU seconds between a job's creation and Running, on the
same two cores as the API server, scheduler and KWOK it was waiting for (issue 42). Here an
event costs one ``json.loads`` and the handler.

``WatchState`` is the pure part: what a listing or a watch event means (which events to
deliver, whether to list again, the resourceVersion to resume from); ``CollectionWatch``
drives it against the API server with reconnects and backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bulkhead.operator.k8s.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

Event = tuple[str, dict[str, Any]]  # ("ADDED" | "MODIFIED" | "DELETED", object)
Handler = Callable[[str, dict[str, Any]], Awaitable[None]]

WATCH_TIMEOUT_S = 300  # the server ends a watch after this; we resume from where it was
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
LIST_PAGE = 500


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def resource_version(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


@dataclass
class WatchState:
    """What the feed has delivered so far: the objects (for deletions noticed only by a
    re-list) and the resourceVersion a watch resumes from (None: list first)."""

    resource_version: str | None = None
    known: dict[str, dict[str, Any]] = field(default_factory=dict)

    def listed(self, items: list[dict[str, Any]], list_version: str) -> list[Event]:
        """A complete listing: every object is (re)delivered as ADDED, in the listing's
        order, and objects that vanished while no watch was open as DELETED."""
        fresh = {object_key(obj): obj for obj in items}
        gone = [("DELETED", obj) for key, obj in self.known.items() if key not in fresh]
        self.known = fresh
        self.resource_version = list_version
        return [*gone, *(("ADDED", obj) for obj in items)]

    def watched(self, event: dict[str, Any]) -> Event | None:
        """One watch event: what to deliver (None for bookmarks). An expired
        resourceVersion (410 Gone) resets the state so the driver lists again."""
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                self.resource_version = None
                return None
            raise WatchError(f"watch error: {obj.get('code')} {obj.get('message', obj)}")
        version = resource_version(obj)
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return None
        if kind == "DELETED":
            self.known.pop(object_key(obj), None)
        elif kind in ("ADDED", "MODIFIED"):
            self.known[object_key(obj)] = obj
        else:
            raise WatchError(f"unknown watch event type {kind!r}")
        return (kind, obj)


class WatchError(RuntimeError):
    """The API server ended a watch with an error other than an expired resourceVersion."""


class CollectionWatch:
    """Deliver every change of one collection (``path``, optionally a label selector) to
    ``handle``, in order, for as long as ``run`` runs.

    Reconnects with backoff when the API server is unreachable or refuses, resumes from
    the last resourceVersion seen (bookmarks keep it fresh on quiet collections), and lists
    again when that version has expired. A handler that raises is logged and the feed
    goes on: the next event of that object is delivered as usual.
    """

    def __init__(
        self,
        client: KubeClient,
        path: str,
        handle: Handler,
        *,
        label_selector: str = "",
        name: str = "",
        timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.client = client
        self.path = path
        self.handle = handle
        self.label_selector = label_selector
        self.name = name or path
        self.timeout_s = timeout_s
        self.state = WatchState()
        self.synced = asyncio.Event()  # set once the first listing has been delivered

    async def run(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            try:
                if self.state.resource_version is None:
                    await self._list()
                    self.synced.set()
                await self._watch()
                delay = RETRY_FIRST_S
            except (httpx.HTTPError, KubeError, WatchError, ValueError) as exc:
                if isinstance(exc, KubeError) and exc.status == 410:
                    self.state.resource_version = None
                    continue
                log.warning("watch of %s: %s; retry in %.1fs", self.name, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _list(self) -> None:
        items: list[dict[str, Any]] = []
        params = {"limit": str(LIST_PAGE)}
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        while True:
            page = await self.client.get(self.path, params)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        events = self.state.listed(items, meta.get("resourceVersion") or "")
        log.debug("watch of %s: listed %d objects", self.name, len(items))
        for kind, obj in events:
            await self._deliver(kind, obj)

    async def _watch(self) -> None:
        params = {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.timeout_s),
            "resourceVersion": self.state.resource_version or "",
        }
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        async for event in self.client.watch(self.path, params, self.timeout_s):
            delivered = self.state.watched(event)
            if delivered is not None:
                await self._deliver(*delivered)
            elif self.state.resource_version is None:
                return  # expired: list again

    async def _deliver(self, kind: str, obj: dict[str, Any]) -> None:
        try:
            await self.handle(kind, obj)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("watch of %s: handling %s %s failed", self.name, kind, object_key(obj))
