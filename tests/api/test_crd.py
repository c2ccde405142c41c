"""The committed CRD equals the one generated from the models, and is structural."""

from pathlib import Path

import yaml

from bulkhead.api.crd import CRD_FILE, crd, crd_yaml

REPO = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_models():
    committed = (REPO / CRD_FILE).read_text()
    assert committed == crd_yaml(), "crds/ drifted from bulkhead.api: run `make crd` and commit"


def test_crd_identity_and_columns():
    obj = crd()
    spec = obj["spec"]
    assert obj["metadata"]["name"] == "trainingjobs.bulkhead.dev"
    assert spec["group"] == "bulkhead.dev"
    assert spec["names"]["shortNames"] == ["tj"]
    assert "all" in spec["names"]["categories"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Workers", "Step", "Restarts", "Age"]


def _walk(node, path="$"):
    yield path, node
    for key in ("properties",):
        for name, child in node.get(key, {}).items():
            yield from _walk(child, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    preserving = []
    for path, node in _walk(root):
        assert "type" in node, f"{path} has no type"
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserving.append(path)
    # Only the embedded pod template keeps unknown fields; metadata is handled by the server.
    assert preserving == ["$.spec.template"]


def test_yaml_is_loadable():
    assert yaml.safe_load(crd_yaml())["kind"] == "CustomResourceDefinition"
