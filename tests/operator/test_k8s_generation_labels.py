"""Generation labels on the real API server: members end up labelled with the newest
generation only (older ones replaced before they were sent cost nothing), a pod that left
gets no label, an up-to-date pod costs no request, and it all goes in the background lane."""

from __future__ import annotations

import asyncio

import pytest

from bulkhead.api.status import Member, Membership
from bulkhead.operator.k8s import names
from bulkhead.operator.k8s.generation_labels import GenerationLabels
from bulkhead.operator.k8s.kube import KUBE_REQUESTS, KubeClient, core_path, load_credentials

pytestmark = [pytest.mark.k8s]

PODS = [f"labels-w{i}-0" for i in range(6)]


def _membership(generation: int, workers: list[str]) -> Membership:
    members = [Member(rank=i, worker=w) for i, w in enumerate(workers)]
    return Membership(generation=generation, members=members)


def _background_patches() -> float:
    return KUBE_REQUESTS.labels(lane="background", verb="PATCH")._value.get()


def test_members_get_the_newest_generation_in_the_background(k8s_cluster, k8s_namespace):
    async def scenario() -> dict[str, str | None]:
        client = KubeClient(load_credentials(k8s_cluster.kubeconfig))
        for pod in PODS:  # unschedulable on purpose: only their labels matter
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod},
                "spec": {
                    "nodeSelector": {"bulkhead-test": "nowhere"},
                    "containers": [{"name": "c", "image": "x"}],
                },
            }
            await client.create(core_path("pods", k8s_namespace), body)
        labels = GenerationLabels(client, k8s_namespace)
        try:
            # Three generations in a row, the last without w5: only the newest is wanted.
            labels.follow(_membership(1, PODS))
            labels.follow(_membership(2, PODS))
            labels.follow(_membership(3, PODS[:5]))
            while labels.pending():
                await asyncio.sleep(0.05)
            sent = _background_patches()
            labels.follow(_membership(3, PODS[:5]))  # nothing new: no request
            await asyncio.sleep(0.3)
            assert labels.pending() == 0 and _background_patches() == sent
            got = {}
            for pod in PODS:
                meta = (await client.get(core_path("pods", k8s_namespace, pod)))["metadata"]
                got[pod] = (meta.get("labels") or {}).get(names.LABEL_GENERATION)
            return got
        finally:
            await labels.close()
            await client.close()

    before = _background_patches()
    got = asyncio.run(scenario())
    assert {p: got[p] for p in PODS[:5]} == {p: "3" for p in PODS[:5]}
    # Generations 1 and 2 were replaced before the labeller ran: one PATCH per member of
    # generation 3, none for w5, which left before it.
    assert got[PODS[5]] is None
    assert _background_patches() - before == 5
