"""Reports bound to the member that sends them (issue 36 item 7), over real HTTP.

The job token is in every worker pod; with it alone a worker could report ``complete`` for
every member or a ``user_error`` in a dead member's name. Each worker's registration
answers with its own credential, and the endpoint refuses (and logs and counts) a report
or a poll in a member's name without that member's credential; members declared dead are
ignored whatever they send.
"""

from __future__ import annotations

import logging

import httpx
import pytest
from control_harness import Harness

from bulkhead.api.client import ControlRequestError, HttpControlClient
from bulkhead.api.protocol import (
    MEMBER_HEADER,
    CompletionReport,
    FaultReport,
    ProgressReport,
    RegisterRequest,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.lifecycle.types import WorkerExited
from bulkhead.operator.metrics import REGISTRY

JOB = "demo"
W0, W1, W2 = f"{JOB}-w0-0", f"{JOB}-w1-0", f"{JOB}-w2-0"
STEPS = 1_000


def _spec() -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": 3,
            "minWorkers": 2,
            "trainer": {"steps": STEPS},
            "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 60},
        }
    )


def _ignored(reason: str) -> float:
    value = REGISTRY.get_sample_value("bulkhead_control_ignored_reports_total", {"reason": reason})
    return value or 0.0


@pytest.fixture
def harness():
    with Harness(JOB, _spec()) as h:
        for slot, wid in enumerate((W0, W1, W2)):
            h.client(wid).register(RegisterRequest(worker=wid, address=f"127.0.0.1:{7200 + slot}"))
        h.wait_for(lambda: h.session.state.generation == 1)
        yield h


def _impostor(h: Harness, victim: str) -> HttpControlClient:
    """A client in ``victim``'s name holding W0's credential (what a worker that wants to
    speak for another has: the job token and its own credential)."""
    client = HttpControlClient(h.url, h.token, JOB, victim, member=h.client(W0).member)
    assert client.member.credential is not None
    return client


def test_one_members_credential_cannot_report_for_another(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    h.client(W0).progress(ProgressReport(worker=W0, generation=1, step=3))
    forged = _ignored("wrong_credential")
    impostor = _impostor(h, W1)
    reports = [
        (
            "complete",
            lambda w: impostor.complete(CompletionReport(worker=w, generation=1, step=999)),
        ),
        ("progress", lambda w: impostor.progress(ProgressReport(worker=w, generation=1, step=999))),
        (
            "user_error",
            lambda w: impostor.fault(
                FaultReport(worker=w, generation=1, kind="user_error", message="forged")
            ),
        ),
    ]
    with caplog.at_level(logging.WARNING, logger="bulkhead.operator.session.job"):
        for _, send in reports:
            for victim in (W1, W2):
                with pytest.raises(ControlRequestError) as err:
                    send(victim)
                assert err.value.status_code == 403
                assert "not " + victim in err.value.message
    # Nothing of it reached the job: not finished, not failed, the step is W0's own.
    status = h.session.status
    assert status.phase == "Running" and status.step == 3
    assert h.session.state.finished == frozenset()
    assert _ignored("wrong_credential") - forged == 6
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 6 and all("another member's credential" in m for m in refusals)
    # The member's own credential still works, for its own reports only.
    own = h.client(W1).progress(ProgressReport(worker=W1, generation=1, step=4))
    assert own.action == "continue" and h.session.status.step == 4


def test_forged_reports_without_a_credential_are_refused_and_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    before = _ignored("no_credential")
    prefix = f"{h.url}/v1/jobs/{JOB}"
    token_only = {"Authorization": f"Bearer {h.token}"}
    bodies = {
        "complete": {"worker": W1, "generation": 1, "step": STEPS - 1},
        "progress": {"worker": W1, "generation": 1, "step": STEPS - 1},
        "faults": {"worker": W1, "generation": 1, "kind": "user_error", "message": "forged"},
    }
    with caplog.at_level(logging.WARNING, logger="bulkhead.operator.session.job"):
        for route, body in bodies.items():
            reply = httpx.post(f"{prefix}/{route}", json=body, headers=token_only)
            assert reply.status_code == 401, route
            assert "needs its member credential" in reply.json()["error"]
        # A made-up credential is another member's as far as the endpoint can tell.
        reply = httpx.post(
            f"{prefix}/complete",
            json=bodies["complete"],
            headers={**token_only, MEMBER_HEADER: "0" * 64},
        )
        assert reply.status_code == 403
        # A poll in W1's name would keep it alive to the hang timer: refused too.
        poll = httpx.get(
            f"{prefix}/membership", params={"worker": W1, "timeout": 0}, headers=token_only
        )
        assert poll.status_code == 401
    assert _ignored("no_credential") - before == 4
    assert sum("no member credential" in r.getMessage() for r in caplog.records) == 4
    assert h.session.status.phase == "Running" and not h.session.status.step


def test_a_second_registration_does_not_hand_out_the_credential(harness: Harness) -> None:
    h = harness
    # The addresses are public (every member sees the membership view); the claim and the
    # credential are not. A re-registration with W1's address but not its claim is refused.
    address = next(m.address for m in h.session.state.membership.members if m.worker == W1)
    thief = HttpControlClient(h.url, h.token, JOB, W1)
    with pytest.raises(ControlRequestError) as err:
        thief.register(RegisterRequest(worker=W1, address=address))
    assert err.value.status_code == 409 and "registered already" in err.value.message
    assert thief.member.credential is None
    # W1's own retry (same claim: its first answer was lost) gets its credential again.
    real = h.client(W1)
    again = real.register(RegisterRequest(worker=W1, address=address))
    assert again.credential == real.member.credential


def test_a_member_declared_dead_that_comes_back_is_ignored(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    h.client(W0).progress(ProgressReport(worker=W0, generation=1, step=5))

    async def lose_w2() -> None:  # its pod seen gone (e.g. a partitioned node)
        h.session.observe(WorkerExited(W2, None, 137, "node lost"))

    h.call(lose_w2())
    h.wait_for(lambda: h.session.state.generation == 2)
    before = _ignored("dead_member")
    back = h.client(W2)  # with its own, valid credential
    with caplog.at_level(logging.WARNING, logger="bulkhead.operator.session.job"):
        replies = [
            back.fault(FaultReport(worker=W2, generation=1, kind="user_error", message="late")),
            back.complete(CompletionReport(worker=W2, generation=1, step=STEPS - 1)),
            back.progress(ProgressReport(worker=W2, generation=1, step=STEPS - 1)),
        ]
    assert all(r.action == "stop" for r in replies)
    assert _ignored("dead_member") - before == 3
    assert sum("declared dead" in r.getMessage() for r in caplog.records) == 3
    status = h.session.status
    assert status.phase != "Failed" and status.step == 5
    assert W2 not in h.session.state.finished


def test_a_rotated_job_token_admits_new_pods_and_keeps_running_members(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The job token is rotated where it is kept while the job runs: pods started since
    carry the new one, running workers the old one. The endpoint picks the new token up
    when a request first presents it; the old one goes on admitting only requests that
    carry a member's credential, and unknown tokens cannot make it re-read more than once
    per interval."""
    with Harness(JOB, _spec()) as h:
        for slot, wid in enumerate((W0, W1)):
            h.client(wid).register(RegisterRequest(worker=wid, address=f"127.0.0.1:{7300 + slot}"))
        reads = h.token_reads
        h.stored_token = "n3w-t0ken"
        with caplog.at_level(logging.INFO, logger="bulkhead.operator.session.credentials"):
            # A replacement pod, started after the rotation, registers with the new token.
            h.client(W2, token="n3w-t0ken").register(
                RegisterRequest(worker=W2, address="127.0.0.1:7302")
            )
        assert h.token_reads == reads + 1
        assert any("job token rotated" in r.getMessage() for r in caplog.records)
        h.wait_for(lambda: h.session.state.generation == 1)
        # Running members, old token and their own credentials: reports and polls go on.
        old = h.client(W0)
        assert old.membership(after=0, timeout_s=5).generation == 1
        assert old.progress(ProgressReport(worker=W0, generation=1, step=2)).action == "continue"
        # The old token alone admits nothing else: no registration, no anonymous poll.
        with pytest.raises(ControlRequestError) as err:
            h.client(f"{JOB}-w0-1").register(RegisterRequest(worker=f"{JOB}-w0-1"))
        assert err.value.status_code == 401 and "replaced" in err.value.message
        anonymous = httpx.get(
            f"{h.url}/v1/jobs/{JOB}/membership",
            params={"timeout": 0},
            headers={"Authorization": f"Bearer {h.token}"},
        )
        assert anonymous.status_code == 401
        # Wrong tokens, many: at most one re-read in the interval.
        before = h.token_reads
        for _ in range(20):
            wrong = httpx.get(
                f"{h.url}/v1/jobs/{JOB}/membership",
                params={"timeout": 0},
                headers={"Authorization": "Bearer guess"},
            )
            assert wrong.status_code == 401
        assert h.token_reads - before <= 1


def test_a_worker_that_never_registered_may_report_its_own_user_error() -> None:
    """A worker that finds a bad spec or missing data before it joins has no credential
    yet: its user error still fails the job with its message. Only that: not for a slot
    that registered, nor for an incarnation that is not the slot's current one."""
    with Harness(JOB, _spec()) as h:
        for slot, wid in enumerate((W0, W1)):
            h.client(wid).register(RegisterRequest(worker=wid, address=f"127.0.0.1:{7300 + slot}"))
        prefix = f"{h.url}/v1/jobs/{JOB}"
        token_only = {"Authorization": f"Bearer {h.token}"}

        def user_error(worker: str) -> httpx.Response:
            body = {"worker": worker, "generation": 0, "kind": "user_error", "message": "no-data"}
            return httpx.post(f"{prefix}/faults", json=body, headers=token_only)

        assert user_error(W1).status_code == 401  # registered: its credential is needed
        assert user_error(f"{JOB}-w2-1").status_code in (401, 404)  # not the current one
        assert h.session.status.phase != "Failed"
        assert user_error(W2).status_code == 200
        h.wait_for(lambda: h.session.status.phase == "Failed")
        assert "no-data" in h.session.status.message
