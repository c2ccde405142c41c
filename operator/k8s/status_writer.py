"""Writes TrainingJob status to the API server, rate-limited and coalesced.

Progress (step, loss) changes every few hundred milliseconds on a big job; writing each one
would load the API server for nothing. A change a person or a tool acts on (phase,
conditions, membership generation, restarts, evictions, recoveries) is written at once;
anything else waits until ``min_interval_s`` has passed since the last write, and only the
newest status is written. The live/desired worker count is progress too: while a
thousand pods come up it changes a thousand times, and writing each one (a status
object listing up to a thousand members) would slow the start it reports on. A failed
write is retried with the newest status, so nothing is lost while the operator runs; after
a restart the session republishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.k8s.kube import KubeClient, KubeError, tj_path

log = logging.getLogger(__name__)


def _essence(status: dict[str, Any]) -> tuple[Any, ...]:
    conditions = tuple(
        (c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
        for c in status.get("conditions", [])
    )
    return (
        status.get("phase"),
        conditions,
        (status.get("membership") or {}).get("generation"),
        status.get("restarts"),
        status.get("reconfigurations"),
        tuple(status.get("evictedNodes", [])),
        len(status.get("recoveries", [])),
        tuple(r.get("resumed") for r in status.get("recoveries", [])),
        status.get("message"),
    )


def is_significant(written: dict[str, Any] | None, pending: dict[str, Any]) -> bool:
    """Whether ``pending`` differs from ``written`` in something that must not wait."""
    return written is None or _essence(written) != _essence(pending)


def write_delay(
    written: dict[str, Any] | None,
    pending: dict[str, Any] | None,
    since_last_write_s: float,
    min_interval_s: float,
) -> float | None:
    """Seconds to wait before writing ``pending``; None when there is nothing to write."""
    if pending is None or pending == written:
        return None
    if is_significant(written, pending):
        return 0.0
    return max(0.0, min_interval_s - since_last_write_s)


class StatusWriter:
    """One per job: ``publish`` never blocks; a background task does the writes."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        min_interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._path = tj_path(namespace, name) + "/status"
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._written: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        # Serialised only when the writer looks at it: many publishes between two writes
        # (one per pod event while a big job starts) cost one wire() call, not one each.
        self._newest: TrainingJobStatus | None = None
        self._last_write = -float("inf")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def publish(self, status: TrainingJobStatus) -> None:
        self._newest = status
        self._wake.set()
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._run(), name=f"status-writer {self._path}")

    def _pending_wire(self) -> dict[str, Any] | None:
        """The newest published status in wire form."""
        if self._newest is not None:
            self._pending = self._newest.wire()
            self._newest = None
        return self._pending

    async def write_now(self, status: TrainingJobStatus) -> None:
        """Write a status at once, bypassing the rate limit: for a job that never gets a
        session (an invalid spec), whose one status must land before the handler returns."""
        await self._write(status.wire())

    async def _write(self, status: dict[str, Any]) -> None:
        await self._client.merge_patch(self._path, {"status": status})
        self._written = status
        self._last_write = self._clock()

    async def _run(self) -> None:
        while not self._closed:
            delay = write_delay(
                self._written,
                self._pending_wire(),
                self._clock() - self._last_write,
                self._min_interval_s,
            )
            if delay is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if delay > 0:
                self._wake.clear()
                # A significant status arriving meanwhile cuts the wait short.
                # (asyncio.timeout: a cancellation racing the wake-up is never swallowed.)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                continue
            pending = self._pending
            assert pending is not None
            try:
                await self._write(pending)
            except KubeError as exc:
                if exc.status == 404:
                    log.info("job %s is gone; status writer stops", self._path)
                    return
                log.warning("status write failed, will retry: %s", exc)
                self._last_write = self._clock()  # wait an interval before retrying
                await asyncio.sleep(self._min_interval_s)
            except Exception:  # network errors: keep the newest status and retry
                log.exception("status write failed, will retry")
                await asyncio.sleep(self._min_interval_s)

    async def flush(self) -> None:
        """Write the newest status now (used before stopping)."""
        pending = self._pending_wire()
        if pending is not None and pending != self._written:
            try:
                await self._write(pending)
            except Exception:
                log.exception("final status write for %s failed", self._path)

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
