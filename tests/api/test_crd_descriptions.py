"""Every field and object of the generated CRD has a description, so `kubectl explain`
prints one for each path (the wide printer columns are checked on a real cluster in
tests/k8s/test_kubectl_client.py)."""

from __future__ import annotations

from typing import Any

from bulkhead.api.crd import PRINTER_COLUMNS, crd


def _undescribed(node: dict[str, Any], path: str) -> list[str]:
    found = [] if node.get("description") else [path or "<root>"]
    for name, child in node.get("properties", {}).items():
        if not path and name == "metadata":  # the API server allows only a type there
            continue
        found += _undescribed(child, f"{path}.{name}")
    items = node.get("items")
    if isinstance(items, dict) and items.get("type") == "object":
        found += _undescribed(items, f"{path}[]")
    return found


def test_every_field_and_object_is_described() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _undescribed(schema, "") == []


def test_wide_columns_are_priority_one_and_described() -> None:
    wide = [c for c in PRINTER_COLUMNS if c.get("priority") == 1]
    assert [c["name"] for c in wide] == [
        "Generation",
        "Loss",
        "ValLoss",
        "Checkpoint",
        "Persisted",
        "Message",
    ]
    assert all(c.get("description") for c in wide)
