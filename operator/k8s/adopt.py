"""Pure helpers for adopting a TrainingJob: the values in its Secrets, and which worker
incarnations a previous operator started (see ``names``)."""

from __future__ import annotations

import base64
import json
import logging
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


def decode_secret_value(secret: dict[str, Any], key: str) -> str:
    data = secret.get("data") or {}
    if key not in data:
        raise RuntimeError(f"Secret {secret['metadata']['name']} has no {key!r}")
    return base64.b64decode(data[key]).decode()
