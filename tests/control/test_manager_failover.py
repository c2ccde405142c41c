"""A manager that takes a job over from one that stepped down, over real HTTP: workers that
were still starting keep starting and join; only a worker whose registration the previous
manager took with it is replaced.

The case this guards: a leader's lease reads time out while new pods import torch, the
standby takes over, and (before) it stopped every live pod that was not yet a member,
including pods that had not even registered.
"""

from __future__ import annotations

import pytest
from control_harness import Harness

from bulkhead.api.client import ControlRequestError
from bulkhead.api.protocol import RegisterRequest
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Member, Membership, TrainingJobStatus
from bulkhead.operator.session.credentials import MemberCredentials, new_member_key
from bulkhead.operator.session.job import open_resumed

JOB = "demo"
W0, W1, W2, W3 = (f"{JOB}-w{slot}-0" for slot in range(4))


def _spec() -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": 4,
            "minWorkers": 2,
            "trainer": {"steps": 1_000},
            "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 60},
        }
    )


def _status() -> TrainingJobStatus:
    """What the previous manager persisted: W0 and W1 train in generation 5; W2 and W3 are
    replacements it had started (not members yet)."""
    members = [
        Member(rank=r, worker=w, address=f"127.0.0.1:{7400 + r}") for r, w in enumerate((W0, W1))
    ]
    return TrainingJobStatus(
        phase="Running",
        step=40,
        loss=2.0,
        membership=Membership(generation=5, coordinator=members[0].address, members=members),
    )


@pytest.fixture
def taken_over():
    key = new_member_key()
    live = {W0: "n0", W1: "n1", W2: "n2", W3: "n3"}
    opening = open_resumed(JOB, _spec(), _status(), live)
    with Harness(JOB, _spec(), opening=opening, member_key=key) as h:
        yield h, MemberCredentials(JOB, key)


def test_a_worker_still_starting_is_kept_and_joins(taken_over) -> None:
    h, _ = taken_over
    assert h.driver.stopped == [] and h.driver.started == []
    h.client(W2).register(RegisterRequest(worker=W2, address="127.0.0.1:7402"))
    h.wait_for(lambda: W2 in h.session.state.members())
    assert h.session.state.members()[:2] == [W0, W1]  # the members it took over go on
    assert h.driver.stopped == [] and h.driver.started == []


def test_a_worker_registered_with_the_previous_manager_is_replaced(taken_over) -> None:
    h, previous = taken_over
    # W3 registered with the previous manager, which answered it with its credential.
    client = h.client(W3)
    client.member.credential = previous.issue(W3)
    with pytest.raises(ControlRequestError) as refused:
        client.membership(after=5, timeout_s=0.1)
    assert refused.value.status_code == 409
    assert "previous manager" in str(refused.value)
    h.wait_for(lambda: f"{JOB}-w3-1" in h.driver.started)
    assert [worker for worker, _ in h.driver.stopped] == [W3]
    # The members it took over and the worker still starting are untouched.
    assert h.session.state.members() == [W0, W1]
    h.client(W2).register(RegisterRequest(worker=W2, address="127.0.0.1:7402"))
    h.wait_for(lambda: W2 in h.session.state.members())


def test_a_member_it_took_over_polls_with_its_old_credential(taken_over) -> None:
    """Members registered with the previous manager too: their credential still works."""
    h, previous = taken_over
    client = h.client(W0)
    client.member.credential = previous.issue(W0)
    view = client.membership(after=0, timeout_s=0.1)
    assert [m.worker for m in view.members] == [W0, W1]
    assert h.driver.stopped == []
