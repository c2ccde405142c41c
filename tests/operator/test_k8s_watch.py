"""The operator's own pod and node feeds (``operator/k8s/watch.py``).

The pure ``WatchState`` (what a listing and each watch event mean) in unit tests; the feed
itself against the real API server: list then watch delivers every change in order, a
server-ended watch resumes without losing or repeating events, and a deletion that happened
while no watch was open is delivered as DELETED by the next listing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bulkhead.operator.k8s.kube import KubeClient, core_path, load_credentials
from bulkhead.operator.k8s.watch import CollectionWatch, WatchError, WatchState


def _pod(name: str, version: str, phase: str = "Pending") -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "resourceVersion": version}
    return {"metadata": meta, "status": {"phase": phase}}


def test_a_listing_delivers_every_object_and_the_ones_that_vanished():
    state = WatchState()
    first = state.listed([_pod("a", "1"), _pod("b", "2")], "2")
    assert [(k, o["metadata"]["name"]) for k, o in first] == [("ADDED", "a"), ("ADDED", "b")]
    assert state.resource_version == "2"
    again = state.listed([_pod("b", "5"), _pod("c", "6")], "6")
    assert [(k, o["metadata"]["name"]) for k, o in again] == [
        ("DELETED", "a"),
        ("ADDED", "b"),
        ("ADDED", "c"),
    ]
    assert set(state.known) == {"ns/b", "ns/c"} and state.resource_version == "6"


def test_watch_events_move_the_version_and_bookmarks_deliver_nothing():
    state = WatchState()
    state.listed([_pod("a", "1")], "1")
    assert state.watched({"type": "MODIFIED", "object": _pod("a", "3", "Running")}) == (
        "MODIFIED",
        _pod("a", "3", "Running"),
    )
    assert (
        state.watched({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}})
        is None
    )
    assert state.resource_version == "9"
    assert state.watched({"type": "DELETED", "object": _pod("a", "10")})[0] == "DELETED"
    assert state.known == {} and state.resource_version == "10"


def test_an_expired_version_asks_for_a_listing_and_other_errors_raise():
    state = WatchState()
    state.listed([], "4")
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
    assert state.watched(gone) is None and state.resource_version is None
    with pytest.raises(WatchError, match="500"):
        state.watched({"type": "ERROR", "object": {"code": 500, "message": "boom"}})
    with pytest.raises(WatchError, match="unknown"):
        state.watched({"type": "SURPRISE", "object": {}})


def _configmap(name: str, value: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {"feed": "yes"}},
        "data": {"v": value},
    }


@pytest.mark.k8s
def test_the_feed_lists_watches_resumes_and_relists_on_a_real_api_server(
    k8s_cluster, k8s_namespace
):
    """ConfigMaps stand in for pods (same watch protocol, no scheduler involved)."""

    async def scenario() -> list[tuple[str, str, str | None]]:
        client = KubeClient(load_credentials(k8s_cluster.kubeconfig))
        path = core_path("configmaps", k8s_namespace)
        seen: list[tuple[str, str, str | None]] = []
        changed = asyncio.Event()

        async def handle(kind: str, obj: dict[str, Any]) -> None:
            seen.append((kind, obj["metadata"]["name"], (obj.get("data") or {}).get("v")))
            changed.set()

        async def until(count: int) -> None:
            while len(seen) < count:
                changed.clear()
                await asyncio.wait_for(changed.wait(), 30)

        await client.create(path, _configmap("before", "0"))
        # timeout_s=1: the server ends each watch after a second; the feed must resume.
        feed = CollectionWatch(client, path, handle, label_selector="feed=yes", timeout_s=1)
        task = asyncio.create_task(feed.run())
        try:
            await asyncio.wait_for(feed.synced.wait(), 30)
            await until(1)
            await client.create(path, _configmap("during", "1"))
            await until(2)
            await asyncio.sleep(2.5)  # at least two server-ended watches in between
            await client.merge_patch(f"{path}/during", {"data": {"v": "2"}})
            await until(3)
            # A gap: the feed stops, an object is deleted, and the state's version is
            # forgotten as after a 410: the next listing must report the deletion.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.delete(f"{path}/before")
            await client.create(
                path, {**_configmap("unwatched", "x"), "metadata": {"name": "unwatched"}}
            )
            feed.state.resource_version = None
            task = asyncio.create_task(feed.run())
            await until(5)
            return seen
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()

    seen = asyncio.run(scenario())
    assert seen == [
        ("ADDED", "before", "0"),
        ("ADDED", "during", "1"),
        ("MODIFIED", "during", "2"),
        ("DELETED", "before", "0"),
        ("ADDED", "during", "2"),
    ]
