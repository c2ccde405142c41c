"""What a membership poll costs: one encoding per view, gzip when asked, 304 when current.

Real endpoint over HTTP (the harness); the per-event bookkeeping that keeps registration
and progress independent of the job's size is checked against a brute-force count.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import replace

import httpx
import pytest
from control_harness import Harness

from bulkhead.api.client import HttpControlClient
from bulkhead.api.protocol import (
    DELTA_BASE_HEADER,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    apply_membership_delta,
    membership_delta,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Member
from bulkhead.operator.lifecycle.policy import initial_state
from bulkhead.operator.lifecycle.types import WorkerExited

JOB = "cache"
WORKERS = 3


def _spec(workers: int = WORKERS) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "minWorkers": 1,
            "trainer": {"steps": 20},
            "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 60},
        }
    )


@pytest.fixture
def harness():
    with Harness(JOB, _spec()) as h:
        for slot in range(WORKERS):
            wid = f"{JOB}-w{slot}-0"
            client = HttpControlClient(h.url, h.token, JOB, wid)
            client.register(RegisterRequest(worker=wid, address=f"127.0.0.1:{7100 + slot}"))
        h.wait_for(lambda: h.session.state.generation == 1)
        yield h


def _poll(h: Harness, after: int, timeout: float, **headers: str) -> httpx.Response:
    return httpx.get(
        f"{h.url}/v1/jobs/{JOB}/membership",
        params={"after": after, "timeout": timeout},
        headers={"Authorization": f"Bearer {h.token}", **headers},
        timeout=timeout + 10,
    )


def test_one_encoding_per_view_gzip_when_accepted(harness: Harness) -> None:
    plain = _poll(harness, 0, 1, **{"Accept-Encoding": "identity"})
    zipped = _poll(harness, 0, 1, **{"Accept-Encoding": "gzip"})
    assert plain.status_code == zipped.status_code == 200
    assert "content-encoding" not in plain.headers
    assert zipped.headers["content-encoding"] == "gzip"
    # Same view, same ETag, same bytes once decoded (httpx decodes gzip itself).
    assert plain.headers["etag"] == zipped.headers["etag"] == '"g1-running"'
    assert zipped.content == plain.content
    view = MembershipView.model_validate(json.loads(plain.content))
    assert view.generation == 1 and len(view.members) == WORKERS
    # Both answers came from one encoding the session keeps until the view changes.
    encoded = harness.session.encoded_membership
    assert encoded.view is harness.session.state.membership
    assert gzip.decompress(encoded.gzipped) == encoded.body == plain.content


def test_a_current_poll_waits_and_gets_304_an_outdated_one_answers_at_once(
    harness: Harness,
) -> None:
    etag = _poll(harness, 0, 1).headers["etag"]
    current = _poll(harness, 1, 0.3, **{"If-None-Match": etag})
    assert current.status_code == 304 and current.content == b""
    assert current.headers["etag"] == etag
    # Outdated: the client holds generation 0; the answer is the view, at once.
    outdated = _poll(harness, 0, 60, **{"If-None-Match": '"g0-forming"'})
    assert outdated.status_code == 200 and outdated.elapsed.total_seconds() < 30
    # A stale ETag on a timed-out poll still gets the body (the view moved on in state).
    stale = _poll(harness, 1, 0.2, **{"If-None-Match": '"g1-forming"'})
    assert stale.status_code == 200 and stale.headers["etag"] == etag


def test_client_reuses_its_view_on_304_and_sees_the_next_generation(harness: Harness) -> None:
    worker = f"{JOB}-w0-0"
    client = HttpControlClient(harness.url, harness.token, JOB, worker)
    first = client.membership(after=0, timeout_s=1)
    again = client.membership(after=1, timeout_s=0.3)  # times out: 304, same object back
    assert again is first

    # A member exits: the next poll answers with generation 2 (a body, not a 304).
    async def exit_one() -> None:
        harness.session.observe(WorkerExited(f"{JOB}-w2-0", exit_code=1))

    harness.call(exit_one())
    nxt = client.membership(after=1, timeout_s=5)
    assert nxt.generation == 2 and [m.worker for m in nxt.members] == [worker, f"{JOB}-w1-0"]


def test_progress_from_one_rank_is_enough_for_the_job_step(harness: Harness) -> None:
    client = HttpControlClient(harness.url, harness.token, JOB, f"{JOB}-w0-0")
    for step in range(3):
        report = ProgressReport(worker=f"{JOB}-w0-0", generation=1, step=step)
        assert client.progress(report).action == "continue"
    status = harness.session.status
    assert status.step == 2 and status.phase == "Running"


def test_memoized_counts_match_a_brute_force_count() -> None:
    state = initial_state("memo", _spec(workers=64))

    def brute(s) -> int:
        return sum(1 for x in s.slots if x.status == "registered")

    assert state.live_count() == brute(state) == 0
    for index in [5, 0, 63, 5, 17]:  # 5 twice: a re-registration must not count twice
        slot = state.slots[index]
        state = state.with_slot(replace(slot, status="registered", address=f"h:{index}"))
        assert state.live_count() == brute(state)
        assert state.slots[index].status == "registered"
    state = state.with_slot(replace(state.slots[17], status="pending"))
    assert state.live_count() == brute(state) == 3
    assert [x.index for x in state.slots] == list(range(64))


def _view(generation: int, workers: list[tuple[str, str]], state: str = "running"):
    members = [
        Member(rank=r, worker=w, node=n, address=f"{w}:1", checkpoint_address=f"{w}:2")
        for r, (w, n) in enumerate(workers)
    ]
    return MembershipView(
        generation=generation,
        coordinator=members[0].address if members else "",
        members=members,
        state=state,
        resume_step=generation * 10,
        total_steps=100,
    )


@pytest.mark.parametrize(
    "after",
    [
        [("b", "n1"), ("c", "n1"), ("d", "n2")],  # a removed: every survivor shifts a rank
        [("a", "n0"), ("b", "n1"), ("c", "n1"), ("d", "n2"), ("e", "n3")],  # e joined
        [("a", "n0"), ("b", "n9"), ("d", "n2")],  # b moved node, c removed
        [("d", "n2"), ("a", "n0")],  # reordered
        [],
    ],
)
def test_a_delta_rebuilds_the_view_exactly(after: list[tuple[str, str]]) -> None:
    base = _view(1, [("a", "n0"), ("b", "n1"), ("c", "n1"), ("d", "n2")])
    view = _view(2, after, state="restarting")
    delta = membership_delta(base, view)
    assert apply_membership_delta(base, delta) == view
    # Kept members travel as index runs, not as objects.
    assert sum(isinstance(s, dict) for s in delta["members"]) <= 2


def test_a_delta_that_does_not_fit_its_base_is_refused() -> None:
    base = _view(1, [("a", "n0")])
    with pytest.raises(ValueError):
        apply_membership_delta(base, {**membership_delta(base, base), "members": [[0, 5]]})


def test_a_client_holding_the_previous_view_gets_a_delta(harness: Harness) -> None:
    full = _poll(harness, 0, 1)
    held = full.headers["etag"]
    harness.call(_exit(harness, f"{JOB}-w1-0"))
    reply = _poll(harness, 1, 5, **{"If-None-Match": held, "Accept-Encoding": "gzip"})
    assert reply.status_code == 200 and reply.headers[DELTA_BASE_HEADER] == held
    base = MembershipView.model_validate(full.json())
    rebuilt = apply_membership_delta(base, reply.json())
    assert rebuilt == harness.session.state.membership and rebuilt.generation == 2
    assert len(reply.content) < len(full.content) / 2 or WORKERS < 10
    # A client holding a view the session no longer knows gets the whole view.
    whole = _poll(harness, 1, 5, **{"If-None-Match": '"g0-unknown"'})
    assert DELTA_BASE_HEADER not in whole.headers
    assert MembershipView.model_validate(whole.json()) == rebuilt


def test_the_client_follows_deltas_and_recovers_from_one_it_cannot_apply(
    harness: Harness,
) -> None:
    client = HttpControlClient(harness.url, harness.token, JOB, f"{JOB}-w0-0")
    first = client.membership(after=0, timeout_s=1)
    harness.call(_exit(harness, f"{JOB}-w2-0"))
    second = client.membership(after=first.generation, timeout_s=5)
    assert second == harness.session.state.membership and len(second.members) == 2
    # Training goes on (so the next loss is within maxFailures, not a restart).
    client.progress(ProgressReport(worker=f"{JOB}-w0-0", generation=second.generation, step=0))
    # Corrupt what the client holds: the next delta does not apply, and it refetches.
    client._view = _view(second.generation, [])
    harness.call(_exit(harness, f"{JOB}-w1-0"))
    third = client.membership(after=second.generation, timeout_s=5)
    assert third == harness.session.state.membership and third.generation == 3
    assert [m.worker for m in third.members] == [f"{JOB}-w0-0"]


async def _exit(h: Harness, worker: str) -> None:
    h.session.observe(WorkerExited(worker, exit_code=1))
