"""Connection limits of the control endpoint: a deadline for each request's headers and a
cap on open connections (issue 36).

uvicorn arms no timer on a new connection, nor while a request's headers trickle in: 3,000
idle connections held their sockets until the operator's own API calls and Lease renewals
failed with EMFILE. ``GuardedHttpProtocol`` is uvicorn's httptools protocol with

- a headers deadline: a connection must deliver a request's complete headers within
  ``headers_deadline_s`` of opening, or of the first byte of a later request on it, or it
  is closed (a long poll's wait starts after its headers, so it is never cut short);
- a connection cap: beyond ``max_connections`` open connections a new one is closed at
  once, with a warning at most every ``CAP_LOG_EVERY_S`` that says how many are open.

Idle keep-alive connections between requests are uvicorn's ``timeout_keep_alive``.
``connection_cap`` derives the cap from the open-file limit, keeping a reserve of file
descriptors for the operator's own API calls, Lease renewals and files.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

CAP_LOG_EVERY_S = 10.0
RESERVED_FDS = 512  # the operator's own sockets and files, never taken by workers


def connection_cap() -> int:
    """Connections the endpoint may hold: the soft open-file limit less a reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(64, soft - RESERVED_FDS)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a headers deadline and a connection cap."""

    headers_deadline_s = 10.0
    max_connections = 10_000
    _last_cap_log = -float("inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_timer: asyncio.TimerHandle | None = None
        self._refused = False

    @classmethod
    def configured(cls, headers_deadline_s: float, max_connections: int) -> type[Any]:
        """A subclass with these limits (uvicorn builds one protocol per connection)."""
        limits = {"headers_deadline_s": headers_deadline_s, "max_connections": max_connections}
        return type("GuardedHttpProtocol", (cls,), limits)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        cls = type(self)
        now = time.monotonic()
        if now - cls._last_cap_log >= CAP_LOG_EVERY_S:
            cls._last_cap_log = now
            log.warning(
                "control endpoint: %d connections open, at its cap of %d: refusing new ones "
                "(workers retry; a flood of idle connections is closed after %.0f s)",
                len(self.connections),
                self.max_connections,
                self.headers_deadline_s,
            )
        self._refused = True
        transport.abort()

    def _arm(self) -> None:
        self._disarm()
        self._headers_timer = self.loop.call_later(self.headers_deadline_s, self._too_slow)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _too_slow(self) -> None:
        self._headers_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._headers_timer is None:  # a later request on a kept-alive connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:  # a refused connection was never set up
            super().connection_lost(exc)
