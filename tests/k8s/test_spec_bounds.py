"""The API server and pydantic agree on every spec field at its bounds and on every
cross-field rule they both can check: what `kubectl apply` lets in, the operator runs.

Each bounded field of the committed CRD (generated from ``api/spec.py``) is created with
``dryRun=All`` at its bound and one step past it, against the real API server, and the
server's verdict is compared with ``TrainingJob.model_validate``. Cross-field rules are
broken one at a time and both must refuse, naming the same field with the same message.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from k8s_fixtures import Cluster
from k8s_helpers import CRD_PATH, example_job
from kubernetes import client
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from bulkhead.api.manifest import field_errors
from bulkhead.api.spec import TrainingJob

pytestmark = pytest.mark.k8s

GROUP, VERSION, PLURAL = "bulkhead.dev", "v1alpha1", "trainingjobs"

# Settings that make a field's bound valid on its own: a value at its bound may break a
# cross-field rule (nHeads 512 must divide dModel), which is checked separately below.
COMPANIONS: dict[str, dict[str, Any]] = {
    "spec.workers": {"spec.minWorkers": 1, "spec.faultTolerance.maxFailures": 0},
    "spec.trainer.model.nHeads": {"spec.trainer.model.dModel": 65536},
    "spec.trainer.model.nKvHeads": {
        "spec.trainer.model.dModel": 65536,
        "spec.trainer.model.nHeads": 512,
    },
    "spec.trainer.model.moe.numExperts": {"spec.trainer.model.moe.topK": 2},
    "spec.trainer.model.moe.topK": {"spec.trainer.model.moe.numExperts": 1024},
    "spec.trainer.model.ropeScaling.lowFreqFactor": {
        "spec.trainer.model.ropeScaling.highFreqFactor": 1e6
    },
    "spec.trainer.model.ropeScaling.highFreqFactor": {
        "spec.trainer.model.ropeScaling.lowFreqFactor": 5e-324
    },
    "spec.trainer.model.ropeScaling.factor": {},
    "spec.trainer.parallelism.pipeline.minStages": {
        "spec.workers": 2048,
        "spec.minWorkers": 1,
        "spec.trainer.parallelism.pipeline.maxStages": 1024,
    },
    "spec.trainer.parallelism.pipeline.maxStages": {},
    "spec.trainer.parallelism.experts": {"spec.trainer.model.moe": {}},
    "spec.trainer.parallelism.experts.minReplicas": {
        "spec.trainer.model.moe": {},
        "spec.workers": 1024,
        "spec.faultTolerance.maxFailures": 0,
    },
    "spec.trainer.parallelism.zero.hpzPartitionSize": {
        "spec.workers": 4096,
        "spec.faultTolerance.maxFailures": 1,
        "spec.trainer.parallelism.zero.stage": 3,
    },
    "spec.trainer.batch.microBatchSize": {"spec.trainer.batch.globalBatchSize": 65536},
    "spec.trainer.batch.globalBatchSize": {"spec.trainer.batch.microBatchSize": 1},
    "spec.trainer.optimizer.lr": {"spec.trainer.optimizer.minLr": 0},
    "spec.trainer.optimizer.minLr": {
        "spec.trainer.optimizer.lr": 10,
        "spec.trainer.optimizer.schedule": "cosine",
    },
    "spec.trainer.optimizer.warmupSteps": {"spec.trainer.steps": 1_000_000_000},
    "spec.trainer.optimizer.decaySteps": {
        "spec.trainer.steps": 1_000_000_000,
        "spec.trainer.optimizer.schedule": "cosine",
    },
    "spec.trainer.eval.path": {"spec.trainer.data": {"format": "tokens", "path": "/data"}},
    "spec.trainer.data.path": {"spec.trainer.data.format": "tokens"},
    "spec.trainer.data.mix": {"spec.trainer.data.format": "tokens"},
    "spec.trainer.data.mix[].path": {"spec.trainer.data.format": "tokens"},
    "spec.trainer.data.mix[].weight": {"spec.trainer.data.format": "tokens"},
    "spec.faultTolerance.maxFailures": {"spec.workers": 10_001},
    "spec.faultTolerance.backoff.initialSeconds": {"spec.faultTolerance.backoff.maxSeconds": 3600},
    "spec.faultTolerance.backoff.maxSeconds": {"spec.faultTolerance.backoff.initialSeconds": 0.01},
}

# Objects a nested field needs around it (their required fields), when the example lacks them.
PARENTS: dict[str, dict[str, Any]] = {
    "spec.trainer.model.pretrained": {"path": "/weights"},
    "spec.trainer.model.ropeScaling": {},
    "spec.trainer.model.moe": {},
    "spec.trainer.parallelism.pipeline": {},
    "spec.trainer.parallelism.experts": {},
    "spec.trainer.eval": {"intervalSteps": 10},
}


@dataclass(frozen=True)
class Case:
    path: str  # dotted, "[]" for the items of a list
    value: Any
    inside: bool  # at the bound (valid on its own) or one step past it

    @property
    def id(self) -> str:
        return f"{self.path}={'at' if self.inside else 'past'}:{_short(self.value)}"


def _short(value: Any) -> str:
    if isinstance(value, str | list) and len(value) > 8:
        return f"len{len(value)}"
    return repr(value)


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _numbers(node: dict[str, Any]) -> Iterator[tuple[Any, bool]]:
    """(value, inside) at each numeric bound of ``node``, and one step past it."""
    integer = node["type"] == "integer"
    for key, outward in (("minimum", -math.inf), ("maximum", math.inf)):
        if key not in node:
            continue
        bound = node[key]
        exclusive = node.get(f"exclusive{key.capitalize()}", False)
        if integer:
            step = 1 if outward > 0 else -1
            at = bound - step if exclusive else bound
            yield int(at), True
            yield int(at + step), False
        else:
            at = math.nextafter(bound, -outward) if exclusive else float(bound)
            yield at, True
            yield (float(bound) if exclusive else math.nextafter(bound, outward)), False


def _strings(node: dict[str, Any]) -> Iterator[tuple[Any, bool]]:
    # An absolute path satisfies every pattern a bounded string has in the spec.
    if "minLength" in node:
        n = node["minLength"]
        yield "/" + "a" * (n - 1), True
        yield "/" + "a" * (n - 2) if n >= 2 else "", False
    if "maxLength" in node:
        n = node["maxLength"]
        yield "/" + "a" * (n - 1), True
        yield "/" + "a" * n, False


def _mix(n: int) -> list[dict[str, Any]]:
    return [{"path": f"/data/{i}", "weight": 1.0} for i in range(n)]


def cases() -> list[Case]:
    """Every bound in the spec schema (the pod template is Kubernetes' own)."""
    found: list[Case] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return
        kind = node.get("type")
        values: list[tuple[Any, bool]] = []
        if kind in ("integer", "number"):
            values = list(_numbers(node))
        elif kind == "string":
            values = list(_strings(node))
        elif kind == "array" and node["items"].get("type") == "object":
            for key in ("minItems", "maxItems"):
                if key in node:
                    n = node[key]
                    outward = -1 if key == "minItems" else 1
                    values += [(_mix(n), True), (_mix(n + outward), False)]
        elif kind == "array" and "minItems" in node:  # optimizer betas: a fixed pair
            n = node["minItems"]
            values = [([0.9] * n, True), ([0.9] * (n - 1), False), ([0.9] * (n + 1), False)]
        found.extend(Case(path, v, inside) for v, inside in values)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if kind == "array":
            walk(node["items"], f"{path}[]")

    walk(_spec_schema(), "spec")
    return found


def _put(job: dict[str, Any], path: str, value: Any) -> None:
    """Set ``path`` (dotted; "[]" sets the field of the first item of a data mix)."""
    if "[]" in path:
        head, leaf = path.split("[].")
        _put(job, head, _mix(2))
        _get(job, head)[0][leaf] = value
        return
    *parents, leaf = path.split(".")
    node = job
    walked = ""
    for key in parents:
        walked = f"{walked}.{key}" if walked else key
        if key not in node:
            node[key] = copy.deepcopy(PARENTS.get(walked, {}))
        node = node[key]
    node[leaf] = value


def _get(job: dict[str, Any], path: str) -> Any:
    node: Any = job
    for key in path.split("."):
        node = node[key]
    return node


def _job_with(case: Case) -> dict[str, Any]:
    job = example_job("bounds")
    # The example's own settings a bound may not fit with: a plain dense GPT, text data.
    job["spec"]["trainer"]["model"] = {}
    head = case.path.split("[]")[0]
    parent = head.rsplit(".", 1)[0]
    companions = COMPANIONS.get(case.path) or COMPANIONS.get(head) or COMPANIONS.get(parent, {})
    for path, value in companions.items():
        _put(job, path, value)
    _put(job, case.path, case.value)
    return job


def _pydantic_errors(job: dict[str, Any]) -> list[str]:
    try:
        TrainingJob.model_validate(job)
    except ValidationError as exc:
        return [str(e) for e in field_errors(exc)]
    return []


def _server_refusal(api: client.CustomObjectsApi, namespace: str, job: dict[str, Any]) -> str:
    """The API server's message refusing ``job`` (dryRun=All: nothing is stored); ''."""
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job, dry_run="All")
    except ApiException as exc:
        assert exc.status == 422, exc.body
        return json.loads(exc.body)["message"]
    return ""


def test_every_bound_is_enumerated() -> None:
    """The walk finds the bounds it is meant to (a schema change cannot empty it)."""
    paths = {c.path for c in cases()}
    for expected in (
        "spec.workers",
        "spec.trainer.model.dropout",
        "spec.checkpoint.storage.path",
        "spec.trainer.data.mix",
        "spec.trainer.data.mix[].weight",
        "spec.trainer.optimizer.betas",
        "spec.faultTolerance.backoff.initialSeconds",
    ):
        assert expected in paths
    assert len(paths) >= 60


# Bounds no valid spec reaches: highFreqFactor must exceed lowFreqFactor, itself > 0.
UNREACHABLE = {"spec.trainer.model.ropeScaling.highFreqFactor=at:5e-324"}


def test_each_bound_alone_is_valid_and_one_step_past_is_not() -> None:
    """Pydantic's side: with its companions, a bound is the only thing that decides."""
    wrong = []
    for case in cases():
        if case.id in UNREACHABLE:
            continue
        errors = _pydantic_errors(_job_with(case))
        if bool(errors) == case.inside:
            wrong.append((case.id, errors))
    assert wrong == []


def test_the_api_server_agrees_with_pydantic_at_every_bound(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    api = client.CustomObjectsApi(k8s_cluster.api_client())
    disagreements = []
    for case in cases():
        job = _job_with(case)
        ours = _pydantic_errors(job)
        server = _server_refusal(api, k8s_namespace, job)
        if bool(ours) != bool(server):
            disagreements.append((case.id, ours, server[:300]))
    assert disagreements == []
    assert not k8s_cluster.kubectl("get", "tj", "-n", k8s_namespace, "-o", "name").stdout


# One broken cross-field rule each (path -> value on top of the example), and the field
# both must name. Rules that read the pod template's GPUs or the shard-group arithmetic
# are the operator's alone (tests/operator: Valid=False with the same message).
CROSS_FIELD: dict[str, tuple[dict[str, Any], str]] = {
    "top-k": ({"spec.trainer.model.moe": {"numExperts": 2, "topK": 3}}, "trainer.model.moe.topK"),
    "rope-order": (
        {"spec.trainer.model.ropeScaling": {"lowFreqFactor": 4.5, "highFreqFactor": 0.25}},
        "trainer.model.ropeScaling.highFreqFactor",
    ),
    "heads": ({"spec.trainer.model": {"dModel": 64, "nHeads": 3}}, "trainer.model.nHeads"),
    "kv-heads": ({"spec.trainer.model": {"nHeads": 4, "nKvHeads": 3}}, "trainer.model.nKvHeads"),
    # Sizes not given are their defaults when no preset or checkpoint replaces them.
    "heads-default": ({"spec.trainer.model": {"nHeads": 3}}, "trainer.model.nHeads"),
    "kv-heads-default": ({"spec.trainer.model": {"nKvHeads": 3}}, "trainer.model.nKvHeads"),
    "top-k-default": ({"spec.trainer.model.moe": {"topK": 5}}, "trainer.model.moe.topK"),
    "stages": (
        {"spec.trainer.parallelism.pipeline": {"minStages": 2, "maxStages": 1}},
        "trainer.parallelism.pipeline.maxStages",
    ),
    "hpz-stage": (
        {"spec.trainer.parallelism.zero": {"stage": 2, "hpzPartitionSize": 2}},
        "trainer.parallelism.zero.hpzPartitionSize",
    ),
    "experts-zero": (
        {
            "spec.trainer.model": {"preset": "tiny-moe"},
            "spec.trainer.parallelism": {"experts": {}, "zero": {"stage": 1}},
        },
        "trainer.parallelism.zero.stage",
    ),
    "micro-batch": (
        {"spec.trainer.batch": {"globalBatchSize": 4, "microBatchSize": 8}},
        "trainer.batch.microBatchSize",
    ),
    "min-lr": (
        {"spec.trainer.optimizer": {"lr": 0.0003, "minLr": 0.5, "schedule": "cosine"}},
        "trainer.optimizer.minLr",
    ),
    "constant-decay": (
        {"spec.trainer.optimizer": {"schedule": "constant", "decaySteps": 10}},
        "trainer.optimizer.schedule",
    ),
    "tokens-no-path": ({"spec.trainer.data": {"format": "tokens"}}, "trainer.data.path"),
    "text-path": ({"spec.trainer.data": {"path": "/data"}}, "trainer.data.path"),
    "text-mix": (
        {"spec.trainer.data": {"mix": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 2}]}},
        "trainer.data.mix",
    ),
    "path-and-mix": (
        {
            "spec.trainer.data": {
                "format": "tokens",
                "path": "/data",
                "mix": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 2}],
            }
        },
        "trainer.data.mix",
    ),
    "eval-two-sources": (
        {
            "spec.trainer.data": {"format": "tokens", "path": "/data"},
            "spec.trainer.eval": {"intervalSteps": 5, "path": "/val", "heldOutFraction": 0.1},
        },
        "trainer.eval.heldOutFraction",
    ),
    "eval-path-text": (
        {"spec.trainer.eval": {"intervalSteps": 5, "path": "/val"}},
        "trainer.eval.path",
    ),
    "decay-past-steps": (
        {
            "spec.trainer.steps": 100,
            "spec.trainer.optimizer": {"schedule": "wsd", "warmupSteps": 30, "decaySteps": 80},
        },
        "trainer.optimizer.decaySteps",
    ),
    "backoff-order": (
        {"spec.faultTolerance.backoff": {"initialSeconds": 30, "maxSeconds": 2.5}},
        "faultTolerance.backoff.maxSeconds",
    ),
    "min-workers": ({"spec.minWorkers": 9}, "minWorkers"),
    "max-failures": ({"spec.faultTolerance.maxFailures": 4}, "faultTolerance.maxFailures"),
    "pipeline-workers": (
        {"spec.trainer.parallelism.pipeline": {"minStages": 3}},
        "trainer.parallelism.pipeline.minStages",
    ),
    "experts-dense": (
        {"spec.trainer.model": {}, "spec.trainer.parallelism.experts": {}},
        "trainer.parallelism.experts",
    ),
    "expert-replicas": (
        {"spec.trainer.parallelism.experts": {"minReplicas": 1}},
        "trainer.parallelism.experts.minReplicas",
    ),
}


def _broken(settings: dict[str, Any]) -> dict[str, Any]:
    job = example_job("rules")
    for path, value in settings.items():
        _put(job, path, copy.deepcopy(value))
    return job


@pytest.mark.parametrize("rule", CROSS_FIELD)
def test_pydantic_refuses_each_broken_rule_at_its_field(rule: str) -> None:
    settings, field = CROSS_FIELD[rule]
    errors = _pydantic_errors(_broken(settings))
    assert len(errors) == 1 and errors[0].startswith(f"spec.{field}: "), errors


def _without_values(message: str) -> str:
    """What the API server can say of pydantic's message: all but the values it adds."""
    return re.sub(r" \(got [^()]*\)$", "", message)


def test_the_api_server_refuses_each_broken_rule_in_pydantics_words(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    """`kubectl apply` refuses what the operator would refuse later, with the same field and
    message as `bulkhead validate` (the CEL rule and the pydantic rule share it; validate
    adds the values compared, which CEL cannot format within the CRD's cost budget)."""
    api = client.CustomObjectsApi(k8s_cluster.api_client())
    different = []
    for rule, (settings, _) in CROSS_FIELD.items():
        job = _broken(settings)
        [ours] = _pydantic_errors(job)
        field, message = _without_values(ours).split(": ", 1)
        server = _server_refusal(api, k8s_namespace, job)
        if f'{field}: Invalid value: "object": {message}' not in server:
            different.append((rule, ours, server[:400]))
    assert different == []


def test_the_api_server_fills_no_model_size_so_a_size_at_its_default_overrides_the_preset(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    """A preset's sizes are overridden by every size the manifest gives, also one equal to
    its default: the CRD has no defaults for them (the API server would fill them in, and
    nothing could tell a default from a given value), and what a worker parses is what the
    manifest's author wrote."""
    from bulkhead.trainer.config import train_config

    api = client.CustomObjectsApi(k8s_cluster.api_client())
    job = example_job("given-sizes")
    job["spec"]["trainer"]["model"] = {
        "preset": "tiny-moe", "nLayers": 4, "moe": {"numExperts": 4, "topK": 1},
    }  # fmt: skip
    job["spec"]["trainer"]["parallelism"] = {}
    stored = api.create_namespaced_custom_object(
        GROUP, VERSION, k8s_namespace, PLURAL, job, dry_run="All"
    )
    model = stored["spec"]["trainer"]["model"]
    assert model == {"family": "gpt", **job["spec"]["trainer"]["model"]}, model
    parsed = TrainingJob.model_validate(stored).spec
    worker_sees = TrainingJob.model_validate({**stored, "spec": parsed.wire()}).spec
    sizes = train_config(worker_sees).model
    # nLayers 4 is the field's default, and the tiny-moe preset has 2 layers; the preset's
    # 4 experts are given again, its top-k 2 is overridden, its width kept.
    assert (sizes.n_layers, sizes.d_model) == (4, 64)
    assert sizes.moe is not None and (sizes.moe.num_experts, sizes.moe.top_k) == (4, 1)
