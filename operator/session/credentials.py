"""Member credentials: what binds a report to the worker that sends it.

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

import hashlib
import hmac
import secrets
from typing import Literal

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
