"""Pure helpers for adopting a TrainingJob: the token and member key in its Secret, and
which worker incarnations a previous operator started (see ``names``)."""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any

from bulkhead.operator.k8s import names

log = logging.getLogger(__name__)


def incarnations_of(meta: dict[str, Any]) -> dict[int, int]:
    raw = (meta.get("annotations") or {}).get(names.ANNOTATION_INCARNATIONS)
    try:
        return {int(k): int(v) for k, v in json.loads(raw).items()} if raw else {}
    except (ValueError, AttributeError):
        log.warning("ignoring unreadable annotation %s=%r", names.ANNOTATION_INCARNATIONS, raw)
        return {}


@dataclass(frozen=True)
class JobSecrets:
    token: str
    member_key: str | None  # None in a Secret written before member credentials existed


def decode_secret(secret: dict[str, Any]) -> JobSecrets:
    data = secret.get("data") or {}
    if names.TOKEN_KEY not in data:
        raise RuntimeError(f"Secret {secret['metadata']['name']} has no {names.TOKEN_KEY!r}")
    member_key = data.get(names.MEMBER_KEY_KEY)
    return JobSecrets(
        base64.b64decode(data[names.TOKEN_KEY]).decode(),
        base64.b64decode(member_key).decode() if member_key else None,
    )
