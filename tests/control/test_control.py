"""The control endpoint and its client over real HTTP: protocol flow, auth, bad input."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from control_harness import Harness

from bulkhead.api.client import ControlRequestError, ControlUnavailable, HttpControlClient
from bulkhead.api.protocol import (
    ENDPOINT_ENV,
    JOB_ENV,
    TOKEN_ENV,
    WORKER_ENV,
    CompletionReport,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.lifecycle.types import WorkerExited

JOB = "demo"


async def _observe(h: Harness, event: WorkerExited) -> None:
    """A driver observation, delivered on the session's event loop as a driver would."""
    h.session.observe(event)


def _spec(workers: int = 2, steps: int = 5) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "minWorkers": 1,
            "trainer": {"steps": steps},
            "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 60},
        }
    )


@pytest.fixture
def harness():
    with Harness(JOB, _spec()) as h:
        yield h


def _client(h: Harness, worker: str | None = None, **kw) -> HttpControlClient:
    return h.client(worker, **kw)


def _register_all(h: Harness) -> None:
    for slot in range(2):
        wid = f"{JOB}-w{slot}-0"
        _client(h, wid).register(RegisterRequest(worker=wid, address=f"127.0.0.1:{7000 + slot}"))


def test_protocol_flow_from_registration_to_success(harness: Harness) -> None:
    h = harness
    assert h.driver.started == ["demo-w0-0", "demo-w1-0"]
    w0, w1 = _client(h, "demo-w0-0"), _client(h, "demo-w1-0")
    got: list[MembershipView] = []
    # A long poll started before the job forms answers as soon as generation 1 exists.
    poller = threading.Thread(target=lambda: got.append(w0.membership(after=0, timeout_s=20)))
    w0.register(RegisterRequest(worker="demo-w0-0", address="127.0.0.1:7000"))
    poller.start()
    reply = w1.register(RegisterRequest(worker="demo-w1-0", address="127.0.0.1:7001"))
    poller.join(20)
    assert reply.worker == "demo-w1-0"
    (view,) = got
    assert view.generation == 1 and view.state == "running"
    assert [m.worker for m in view.members] == ["demo-w0-0", "demo-w1-0"]
    assert view.coordinator == "127.0.0.1:7000" and view.total_steps == 5

    for step in range(5):
        for client, wid in ((w0, "demo-w0-0"), (w1, "demo-w1-0")):
            directive = client.progress(
                ProgressReport(worker=wid, generation=1, step=step, loss=3.0 - step / 10)
            )
            assert directive.action == "continue"
    assert h.session.status.step == 4
    first = w0.complete(CompletionReport(worker="demo-w0-0", generation=1, step=4, loss=2.6))
    assert h.session.status.phase != "Succeeded"  # one member is not the whole job
    assert first.action == "continue"
    done = w1.complete(CompletionReport(worker="demo-w1-0", generation=1, step=4, loss=2.6))
    assert done.action == "stop"
    assert h.session.status.phase == "Succeeded"
    after = w1.membership(after=1, timeout_s=5)
    assert after.state == "succeeded"
    h.wait_for(lambda: bool(h.driver.statuses) and h.driver.statuses[-1].phase == "Succeeded")


def test_lost_worker_yields_a_new_generation_and_a_stop_for_the_dead(harness: Harness) -> None:
    h = harness
    _register_all(h)
    w0, w1 = _client(h, "demo-w0-0"), _client(h, "demo-w1-0")
    assert w0.membership(0, 5).generation == 1
    h.call(_observe(h, WorkerExited("demo-w1-0", None, 9, "")))
    view = w0.membership(after=1, timeout_s=10)
    assert view.generation == 2
    assert [m.worker for m in view.members] == ["demo-w0-0"]
    assert "demo-w1-1" in h.driver.started
    # The old generation is stale for the survivor; the dead worker is told to stop.
    stale = w0.progress(ProgressReport(worker="demo-w0-0", generation=1, step=0))
    assert stale.action == "reconfigure" and stale.generation == 2
    dead = w1.progress(ProgressReport(worker="demo-w1-0", generation=1, step=0))
    assert dead.action == "stop"
    with pytest.raises(ControlRequestError) as err:
        w1.register(RegisterRequest(worker="demo-w1-0"))
    assert err.value.status_code == 409 and "declared dead" in err.value.message
    with pytest.raises(ControlRequestError) as err:
        w1.membership(after=0, timeout_s=1)
    assert err.value.status_code == 409


def test_long_poll_times_out_with_the_current_generation(harness: Harness) -> None:
    _register_all(harness)
    client = _client(harness, "demo-w0-0")
    started = time.monotonic()
    view = client.membership(after=1, timeout_s=0.5)
    assert view.generation == 1
    assert time.monotonic() - started >= 0.4


def test_auth_errors_are_clear(harness: Harness) -> None:
    url = f"{harness.url}/v1/jobs/{JOB}/register"
    body = {"worker": "demo-w0-0"}
    missing = httpx.post(url, json=body)
    assert missing.status_code == 401 and "Authorization" in missing.json()["error"]
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "unknown job or wrong token" in wrong.json()["error"]
    basic = httpx.post(url, json=body, headers={"Authorization": "Basic abc"})
    assert basic.status_code == 401
    # An unknown job reads exactly like a wrong token: job names cannot be probed.
    other = httpx.post(
        f"{harness.url}/v1/jobs/other/register",
        json=body,
        headers={"Authorization": "Bearer s3cret"},
    )
    assert (other.status_code, other.json()) == (wrong.status_code, wrong.json())


def test_bodies_are_refused_unread_without_the_token_or_over_the_cap(harness: Harness) -> None:
    url = f"{harness.url}/v1/jobs/{JOB}/progress"
    huge = b"{" + b" " * (2 << 20) + b"}"
    anonymous = httpx.post(url, content=huge, headers={"Content-Type": "application/json"})
    assert anonymous.status_code == 401  # the token first: nothing was parsed
    good = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    too_big = httpx.post(url, content=huge, headers=good)
    assert too_big.status_code == 413 and "body over" in too_big.json()["error"]

    def chunks():  # no Content-Length: the cap holds while streaming
        for _ in range(40):
            yield b" " * 65536

    streamed = httpx.post(url, content=chunks(), headers=good)
    assert streamed.status_code == 413


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("register", {}, "worker"),
        ("register", {"worker": "demo-w0-0", "colour": "red"}, "colour"),
        ("progress", {"worker": "demo-w0-0", "generation": 1, "step": -1}, "step"),
        ("progress", {"worker": "demo-w0-0", "generation": "one", "step": 1}, "generation"),
        ("faults", {"worker": "demo-w0-0", "generation": 1, "kind": "meteor"}, "kind"),
        ("complete", {"worker": "demo-w0-0"}, "generation"),
    ],
)
def test_bad_requests_name_the_field(harness: Harness, route: str, body: dict, field: str) -> None:
    reply = httpx.post(
        f"{harness.url}/v1/jobs/{JOB}/{route}",
        json=body,
        headers={"Authorization": f"Bearer {harness.token}"},
    )
    assert reply.status_code == 422
    payload = reply.json()
    assert payload["error"].startswith("invalid request")
    assert any(d.startswith(field) for d in payload["details"]), payload


def test_bad_query_and_not_json(harness: Harness) -> None:
    headers = {"Authorization": f"Bearer {harness.token}"}
    reply = httpx.get(f"{harness.url}/v1/jobs/{JOB}/membership?after=-1", headers=headers)
    assert reply.status_code == 422 and "after" in reply.json()["error"]
    reply = httpx.post(
        f"{harness.url}/v1/jobs/{JOB}/progress", content=b"{not json", headers=headers
    )
    assert reply.status_code == 422


def test_unknown_worker_and_future_generation_are_refused(harness: Harness) -> None:
    client = _client(harness, "stranger")
    with pytest.raises(ControlRequestError) as err:
        client.register(RegisterRequest(worker="stranger"))
    assert err.value.status_code == 404 and "not started by job demo" in str(err.value)
    _register_all(harness)
    w0 = _client(harness, "demo-w0-0")
    with pytest.raises(ControlRequestError) as err:
        w0.progress(ProgressReport(worker="demo-w0-0", generation=7, step=1))
    assert err.value.status_code == 409 and "never published" in err.value.message


def test_identities_and_addresses_cannot_be_taken_over(harness: Harness) -> None:
    w0, w1 = _client(harness, "demo-w0-0"), _client(harness, "demo-w1-0")
    w0.register(RegisterRequest(worker="demo-w0-0", address="127.0.0.1:7000"))
    # Another worker claiming a registered address is refused ...
    with pytest.raises(ControlRequestError) as err:
        w1.register(RegisterRequest(worker="demo-w1-0", address="127.0.0.1:7000"))
    assert err.value.status_code == 409 and "belongs to another worker" in err.value.message
    w1.register(RegisterRequest(worker="demo-w1-0", address="127.0.0.1:7001"))
    # ... so is a second process claiming an identity; a retry of the same claim is fine.
    w0.register(RegisterRequest(worker="demo-w0-0", address="127.0.0.1:7000"))
    with pytest.raises(ControlRequestError) as err:
        w0.register(RegisterRequest(worker="demo-w0-0", address="10.9.9.9:7000"))
    assert err.value.status_code == 409 and "another address" in err.value.message
    view = w0.membership(after=0, timeout_s=5)
    assert {m.address for m in view.members} == {"127.0.0.1:7000", "127.0.0.1:7001"}


def test_progress_beyond_the_last_step_is_refused(harness: Harness) -> None:
    _register_all(harness)
    w0 = _client(harness, "demo-w0-0")
    view = w0.membership(after=0, timeout_s=5)
    with pytest.raises(ControlRequestError) as err:  # the job has 5 steps: 0..4
        w0.progress(ProgressReport(worker="demo-w0-0", generation=view.generation, step=5))
    assert err.value.status_code == 422 and "beyond the job's last step 4" in err.value.message
    w0.progress(ProgressReport(worker="demo-w0-0", generation=view.generation, step=4))


def test_user_error_report_fails_the_job(harness: Harness) -> None:
    _register_all(harness)
    w1 = _client(harness, "demo-w1-0")
    reply = w1.fault(
        FaultReport(worker="demo-w1-0", generation=1, kind="user_error", message="bad lr")
    )
    assert reply.action == "stop" and "bad lr" in reply.reason
    status = harness.session.status
    assert status.phase == "Failed" and "bad lr" in status.message
    # The session hands stops to its effect runner, which may still be at it when the
    # reply arrives: wait for the driver to have been asked.
    expected = {"demo-w0-0", "demo-w1-0"}
    harness.wait_for(lambda: {w for w, _ in harness.driver.stopped} == expected, timeout=10)


def test_metrics_count_requests(harness: Harness) -> None:
    _register_all(harness)
    text = httpx.get(f"{harness.url}/metrics").text
    assert 'bulkhead_control_requests_total{code="200",route="/v1/jobs/{job}/register"}' in text
    assert "bulkhead_membership_generations_total" in text


def test_client_retries_then_gives_up_clearly() -> None:
    # Nothing listens on this port: connection refused, retried, then a clear error.
    client = HttpControlClient(
        "http://127.0.0.1:9", "t", JOB, "w", retries=2, backoff_initial_s=0.01, timeout_s=2
    )
    with pytest.raises(ControlUnavailable) as err:
        client.register(RegisterRequest(worker="w"))
    assert "after 3 attempts" in str(err.value) and "register" in str(err.value)


def test_client_from_env_requires_the_contract_variables() -> None:
    with pytest.raises(Exception, match=ENDPOINT_ENV):
        HttpControlClient.from_env({TOKEN_ENV: "t", JOB_ENV: "j"})
    client = HttpControlClient.from_env(
        {ENDPOINT_ENV: "http://127.0.0.1:1", TOKEN_ENV: "t", JOB_ENV: "j", WORKER_ENV: "j-w0-0"}
    )
    assert client.worker == "j-w0-0" and client.job == "j"
