"""Generate the TrainingJob CustomResourceDefinition from the pydantic models.

pydantic emits JSON Schema 2020-12 with ``$ref``/``anyOf``; Kubernetes wants a structural
OpenAPI v3 schema: every node typed, refs inlined, nullable instead of ``anyOf [X, null]``,
boolean exclusive bounds. Only the embedded pod template preserves unknown fields.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from bulkhead.api.spec import (
    API_GROUP,
    API_VERSION,
    JOB_NAME_MAX,
    JOB_NAME_PATTERN,
    JOB_NAME_RULE,
    KIND,
    TrainingJobSpec,
    cel,
)
from bulkhead.api.status import TrainingJobStatus

PLURAL = "trainingjobs"
CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"crds/{CRD_NAME}.yaml"

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Workers",
        "type": "string",
        "jsonPath": ".status.workers",
        "description": "live/desired workers (and ready/desired spares)",
    },
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # Priority 1: shown by `kubectl get -o wide` only.
    {
        "name": "Generation",
        "type": "integer",
        "jsonPath": ".status.membership.generation",
        "description": "membership generation",
        "priority": 1,
    },
    {
        "name": "Loss",
        "type": "number",
        "jsonPath": ".status.loss",
        "description": "loss of the last reported step",
        "priority": 1,
    },
    {
        "name": "ValLoss",
        "type": "number",
        "jsonPath": ".status.valLoss",
        "description": "validation loss of the newest evaluation",
        "priority": 1,
    },
    {
        "name": "Checkpoint",
        "type": "integer",
        "jsonPath": ".status.lastCheckpointStep",
        "description": "newest checkpointed step",
        "priority": 1,
    },
    {
        "name": "Persisted",
        "type": "integer",
        "jsonPath": ".status.lastPersistedStep",
        "description": "newest step on storage",
        "priority": 1,
    },
    {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "description": "why the job is in its phase",
        "priority": 1,
    },
]

_DROP = {"title", "$defs", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **extra}, defs)
    out: dict[str, Any] = {}
    nullable = False
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "anyOf":
            options = [o for o in value if o.get("type") != "null"]
            nullable = len(options) < len(value)
            if len(options) != 1:
                raise ValueError(f"cannot express anyOf {value} structurally")
            out.update(_resolve(options[0], defs))
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out[key.replace("exclusive", "").lower()] = value
            out[key] = True
        elif key == "prefixItems":
            # A fixed-length tuple: all items share one type in our models.
            out["items"] = _resolve(value[0], defs)
            out["minItems"] = out["maxItems"] = len(value)
        elif key == "properties":
            out[key] = {k: _with_object_default(_resolve(v, defs)) for k, v in value.items()}
        else:
            out[key] = _resolve(value, defs)
    if nullable:
        out["nullable"] = True
        if out.get("default", 0) is None:
            del out["default"]
    if "enum" in out and "type" not in out:
        out["type"] = "integer" if all(isinstance(v, int) for v in out["enum"]) else "string"
    free_form = out.get("additionalProperties") in (True, None, {})
    if out.get("type") == "object" and "properties" not in out and free_form:
        out.pop("additionalProperties", None)
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]
    return out


def _with_object_default(prop: dict[str, Any]) -> dict[str, Any]:
    """Sub-objects built by default_factory get a default, so the API server fills the
    nested defaults too when the user omits the whole object."""
    if prop.get("type") == "object" and "properties" in prop and not prop.get("nullable"):
        # The full default, not {}: the API server checks a default against the object's
        # CEL rules, and {} lacks the keys those rules read.
        defaults = {k: v["default"] for k, v in prop["properties"].items() if "default" in v}
        prop.setdefault("default", defaults)
    return prop


def openapi_schema(model: type) -> dict[str, Any]:
    """A structural OpenAPI v3 schema for a pydantic model (by alias, validation mode)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _resolve(raw, raw.get("$defs", {}))


def crd() -> dict[str, Any]:
    """The full CustomResourceDefinition object."""
    spec_schema = openapi_schema(TrainingJobSpec)
    status_schema = openapi_schema(TrainingJobStatus)
    version = {
        "name": API_VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
        "additionalPrinterColumns": PRINTER_COLUMNS,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "description": "A fault-tolerant distributed training job.",
                "required": ["spec"],
                # The API server lets a root rule read metadata.name (and nothing else of
                # metadata): names the operator could not use never get in.
                "x-kubernetes-validations": [
                    cel(
                        f"size(self.metadata.name) <= {JOB_NAME_MAX} && "
                        f"self.metadata.name.matches('{JOB_NAME_PATTERN}')",
                        f"metadata.name: {JOB_NAME_RULE}",
                    )
                ],
                "properties": {
                    "apiVersion": {
                        "type": "string",
                        "description": "Schema version of this object: bulkhead.dev/v1alpha1.",
                    },
                    "kind": {"type": "string", "description": "TrainingJob."},
                    # The API server refuses anything but a type here (kubectl explain
                    # shows ObjectMeta's own description).
                    "metadata": {"type": "object"},
                    "spec": spec_schema,
                    "status": status_schema,
                },
            }
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": "trainingjob",
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": ["tj"],
                "categories": ["all"],
            },
            "versions": [version],
        },
    }


def crd_yaml() -> str:
    """The CRD as committed in ``crds/`` (a header plus stable YAML)."""
    header = "# Generated by `bulkhead crd` from bulkhead.api; do not edit by hand.\n"
    return header + yaml.dump(crd(), Dumper=_NoAliases, sort_keys=False, width=100)


class _NoAliases(yaml.SafeDumper):
    """Writes shared sub-schemas out in full: anchors would make the CRD hard to read."""

    def ignore_aliases(self, data: object) -> bool:
        return True
