"""The agents' token as the agent checks it, rotated without a restart.

A job's workers present ``job_report_token(agents' token, job)``, put in their pod's
environment when the pod was made: it never changes under a running worker. So when the
agents' token is rotated (a new value in the ``bulkhead-agent`` Secret, which the kubelet
writes into the agent's mounted file), the agent admits the new token and the one it
replaced: pods made before the rotation keep reporting, pods made after it present the new
derivation. A token matching neither re-reads the file, at most once per
``REREAD_EVERY_S``, so a flood of wrong tokens costs one small read per interval.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from pathlib import Path

from bulkhead.api.protocol import job_report_token

log = logging.getLogger(__name__)

REREAD_EVERY_S = 5.0


def token_file_reader(path: Path) -> Callable[[], str | None]:
    """Reads the token in ``path`` (a mounted Secret key); None while it is missing or empty."""

    def read() -> str | None:
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            log.warning("cannot read the agents' token file %s: %s", path, exc)
            return None

    return read


class AgentTokens:
    """The current agents' token and the one a rotation replaced."""

    def __init__(
        self,
        read: Callable[[], str | None],
        clock: Callable[[], float] = time.monotonic,
        reread_every_s: float = REREAD_EVERY_S,
    ) -> None:
        self._read = read
        self._clock = clock
        self._reread_every_s = reread_every_s
        self.current = read()
        self.previous: str | None = None
        self._read_at = clock()

    def admits(self, given: str, job: str | None = None) -> bool:
        """Whether ``given`` is the agents' token (``job`` None) or ``job``'s report token,
        under the current agents' token or the one it replaced."""
        if self._matches(given, job):
            return True
        if self._clock() - self._read_at < self._reread_every_s:
            return False
        self._read_at = self._clock()
        fresh = self._read()
        if fresh is None or fresh == self.current:
            return False
        self.previous, self.current = self.current, fresh
        log.warning(
            "the agents' token was rotated: reports are admitted under the new one and, for "
            "pods made before the rotation, the one it replaced"
        )
        return self._matches(given, job)

    def _matches(self, given: str, job: str | None) -> bool:
        for token in (self.current, self.previous):
            if token is None:
                continue
            expected = token if job is None else job_report_token(token, job)
            if hmac.compare_digest(given.encode(), expected.encode()):
                return True
        return False
