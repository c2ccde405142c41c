"""Member credentials (what binds a report to the worker that sends it) and job tokens.

The job token lets a process speak to the job's control endpoint; it is in every worker
pod, so alone it would let any worker report for any other (``complete`` for all members,
a ``user_error`` in a dead member's name). At registration the manager answers each worker
with its own credential, ``HMAC(member key, job, worker id)``, and every report or poll
naming a worker must carry the credential of that worker.

Stateless on purpose: the member key is the only secret. The Kubernetes operator keeps it
in a Secret of the job's that no pod references (``<job>-members``), so a restarted
operator or a new leader
checks the credentials an old one issued; local mode keeps it in memory. A worker id names
one incarnation of a slot, so a replaced worker's credential never speaks for its
replacement.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Literal

log = logging.getLogger(__name__)

Refusal = Literal["no_credential", "wrong_credential"]


def new_member_key() -> str:
    return secrets.token_urlsafe(32)


class MemberCredentials:
    """Issues and checks the member credentials of one job."""

    def __init__(self, job: str, member_key: str | None = None) -> None:
        self._job = job.encode()
        self._key = (member_key or new_member_key()).encode()

    def issue(self, worker: str) -> str:
        message = self._job + b"\0" + worker.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def check(self, worker: str, presented: str | None) -> Refusal | None:
        """None if ``presented`` is ``worker``'s credential, else why not."""
        if not presented:
            return "no_credential"
        if not hmac.compare_digest(presented.encode(), self.issue(worker).encode()):
            return "wrong_credential"
        return None


Admission = Literal["current", "previous"]
# How often a job's token may be re-read from its source (a request with an unknown token
# asks for it): a flood of wrong tokens costs at most one read per interval.
TOKEN_REFRESH_INTERVAL_S = 5.0
# Tokens replaced by a rotation that are still admitted (with a member credential).
KEPT_PREVIOUS_TOKENS = 4


class JobTokens:
    """The job token the endpoint admits, and those a rotation replaced.

    A rotation (a new token in the job's Secret) reaches new pods only: running workers
    keep the token they started with. So the current token admits every request, and a
    previous one only requests that must also carry a member's credential (reports and
    polls in a member's name): a leaked old token alone registers nobody and learns
    nothing. ``source`` re-reads the token where it is kept (Kubernetes: the Secret); a
    request with a token the endpoint does not know asks for that, at most once per
    ``TOKEN_REFRESH_INTERVAL_S``.
    """

    def __init__(
        self,
        token: str,
        source: Callable[[], Awaitable[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        job: str = "",
    ) -> None:
        self.current = token
        self._job = job
        self._previous: list[str] = []
        self._source = source
        self._clock = clock
        self._last_read = -math.inf
        self._reading: asyncio.Task[bool] | None = None

    def admits(self, presented: str) -> Admission | None:
        """Whether ``presented`` is the current token, a previous one, or neither (every
        comparison made, in constant time)."""
        encoded = presented.encode()
        current = hmac.compare_digest(encoded, self.current.encode())
        previous = [hmac.compare_digest(encoded, t.encode()) for t in self._previous]
        return "current" if current else "previous" if any(previous) else None

    def rotate(self, token: str) -> None:
        if token == self.current:
            return
        self._previous = [self.current, *self._previous][:KEPT_PREVIOUS_TOKENS]
        self.current = token

    async def refresh(self) -> bool:
        """Re-read the token from its source (if it may be read again now); True if it
        changed. Concurrent callers share one read."""
        if self._reading is None:
            if self._source is None or self._clock() - self._last_read < TOKEN_REFRESH_INTERVAL_S:
                return False
            self._last_read = self._clock()
            self._reading = asyncio.ensure_future(self._read())
        reading = self._reading
        try:
            return await asyncio.shield(reading)
        finally:
            if reading.done():
                self._reading = None

    async def _read(self) -> bool:
        assert self._source is not None
        try:
            token = await self._source()
        except Exception as exc:  # the endpoint answers 401 as it would have
            log.warning("job %s: could not re-read the job token: %s", self._job, exc)
            return False
        if token == self.current:
            return False
        self.rotate(token)
        log.info(
            "job %s: job token rotated; the previous one is admitted only with a member's "
            "credential",
            self._job,
        )
        return True
