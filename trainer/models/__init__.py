"""Model families (``registry``), the protocol the engine uses (``protocol``) and Hugging Face
weights in and out (``hf``, ``hf_export``, ``pretrained``).

``from bulkhead.trainer.models import from_pretrained`` is imported lazily, so that the
registry and the protocol do not pull in safetensors.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "from_pretrained": "bulkhead.trainer.models.pretrained",
    "PretrainedLM": "bulkhead.trainer.models.pretrained",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
