"""Pure helpers for adopting a TrainingJob: its invalid-spec status, the token in its
Secret, and which worker incarnations a previous operator started (see ``names``)."""

from __future__ import annotations

import base64
import json
import logging
from datetime import datetime
from typing import Any

from bulkhead.api.status import Condition, TrainingJobStatus
from bulkhead.operator.driver import parse_worker_id, worker_id
from bulkhead.operator.k8s import names
from bulkhead.operator.k8s.nodes import rfc3339

log = logging.getLogger(__name__)


def invalid_status(errors: str, now: datetime) -> TrainingJobStatus:
    """Status of a job whose spec passed the schema but not the semantic checks."""
    return TrainingJobStatus(
        phase="Failed",
        conditions=[
            Condition(
                type="Valid",
                status="False",
                reason="InvalidSpec",
                message=errors,
                last_transition_time=rfc3339(now),
            )
        ],
        message=f"invalid spec: {errors}",
    )


def incarnations_of(meta: dict[str, Any]) -> dict[int, int]:
    raw = (meta.get("annotations") or {}).get(names.ANNOTATION_INCARNATIONS)
    try:
        return {int(k): int(v) for k, v in json.loads(raw).items()} if raw else {}
    except (ValueError, AttributeError):
        log.warning("ignoring unreadable annotation %s=%r", names.ANNOTATION_INCARNATIONS, raw)
        return {}


def started_but_unseen(
    job_key: str, incarnations: dict[int, int], live: dict[str, str], status: TrainingJobStatus
) -> dict[str, str]:
    """Incarnations the previous operator started whose pods are gone (or never made it).

    They are handed to the session as workers of unknown whereabouts, so it replaces them
    with the next incarnation instead of reusing their worker ids.
    """
    seen: dict[int, int] = {}
    for wid in [*live, *(m.worker for m in status.membership.members)]:
        parsed = parse_worker_id(wid)
        if parsed is not None:
            seen[parsed[0]] = max(seen.get(parsed[0], -1), parsed[1])
    return {
        worker_id(job_key, slot, incarnation): ""
        for slot, incarnation in incarnations.items()
        if incarnation > seen.get(slot, -1)
    }


def decode_token(secret: dict[str, Any]) -> str:
    data = secret.get("data") or {}
    if names.TOKEN_KEY not in data:
        raise RuntimeError(f"Secret {secret['metadata']['name']} has no {names.TOKEN_KEY!r}")
    return base64.b64decode(data[names.TOKEN_KEY]).decode()
