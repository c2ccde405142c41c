"""Worker identity: slots, incarnations and the worker id that names each (the pod name).

A worker *slot* is one of ``spec.workers`` positions; each (re)start of a slot is a new
*incarnation* with its own worker id ``<name>-w<slot>-<incarnation>``, where ``<name>`` is
the job's name without its namespace (a namespaced pod need not repeat it; the pod's
labels carry job, slot and incarnation). Pure: the lifecycle types and the drivers both
use it, and it imports nothing of the drivers.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_DNS_LABEL_MAX = 63
_ID_PATTERN = re.compile(r"^(?P<job>.+)-w(?P<slot>\d+)-(?P<incarnation>\d+)$")


def worker_id(job: str, slot: int, incarnation: int) -> str:
    """The worker id (and pod name) of a slot incarnation: a valid DNS label.

    ``job`` is the protocol's job key, ``namespace.name`` on Kubernetes (namespaces have no
    dots), or a bare name; the id starts with the name alone. Long names are shortened with
    a hash of the whole key.
    """
    suffix = f"-w{slot}-{incarnation}"
    base = job.split(".", 1)[-1].replace(".", "-")
    if len(base) + len(suffix) > _DNS_LABEL_MAX:
        digest = hashlib.sha256(job.encode()).hexdigest()[:6]
        keep = _DNS_LABEL_MAX - len(suffix) - len(digest) - 1
        base = f"{base[:keep].rstrip('-')}-{digest}"
    return f"{base}{suffix}"


def parse_worker_id(worker: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a worker id, or None if it is not one of ours."""
    match = _ID_PATTERN.match(worker)
    if match is None:
        return None
    return int(match["slot"]), int(match["incarnation"])


@dataclass(frozen=True)
class WorkerRef:
    """One incarnation of one worker slot of a job."""

    job: str
    slot: int
    incarnation: int
    node: str = ""

    @property
    def id(self) -> str:
        return worker_id(self.job, self.slot, self.incarnation)

    def __str__(self) -> str:
        return self.id
