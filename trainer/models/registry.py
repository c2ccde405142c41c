"""Model families by name: the built-in ones, Python entry points, ``module:attribute``.

``spec.trainer.model.family`` names a family: a built-in (``gpt``, ``llama``,
``mixtral``), one a package declares under the entry-point group ``bulkhead.models``, or
``package.module:attribute`` naming a ``ModelFamily`` object directly. Resolution is
deterministic and happens on every rank the same way.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from bulkhead.trainer.models.protocol import ModelFamily

ENTRY_POINT_GROUP = "bulkhead.models"

_FAMILIES: dict[str, ModelFamily] = {}
_BUILTINS = {
    "gpt": "bulkhead.trainer.models.gpt:FAMILY",
    "llama": "bulkhead.trainer.models.llama:FAMILY",
    "mixtral": "bulkhead.trainer.models.mixtral:FAMILY",
}


def register(family: ModelFamily) -> ModelFamily:
    """Make ``family`` known by its name (a second family of the same name is an error)."""
    existing = _FAMILIES.get(family.name)
    if existing is not None and existing is not family:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def _load(target: str, what: str) -> ModelFamily:
    module_name, _, attribute = target.partition(":")
    if not attribute:
        raise ValueError(f"{what}: expected 'module:attribute', got {target!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot load {target!r}: {e}") from e
    if not isinstance(obj, ModelFamily):
        raise ValueError(f"{what}: {target!r} is a {type(obj).__name__}, not a ModelFamily")
    return obj


def family(name: str) -> ModelFamily:
    """The family ``name`` names (see the module docstring); errors say what is known."""
    if name in _FAMILIES:
        return _FAMILIES[name]
    if ":" in name:
        return register(_load(name, "spec.trainer.model.family"))
    if name in _BUILTINS:
        return register(_load(_BUILTINS[name], f"built-in family {name!r}"))
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return register(_load(ep.value, f"entry point {ep.name!r}"))
    declared = (ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    known = sorted({*_BUILTINS, *_FAMILIES, *declared})
    raise ValueError(
        f"spec.trainer.model.family: unknown model family {name!r}; known: {', '.join(known)} "
        f"(or 'module:attribute' of a ModelFamily)"
    )
