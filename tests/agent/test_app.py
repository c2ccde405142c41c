"""The agent's HTTP API on a real server (127.0.0.1, free port) with its loop running:
valid reports are detected, malformed or unauthenticated ones get 4xx and the agent lives on."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from agent_helpers import TEST_SETTINGS, TOKEN
from waiting import wait_until

from bulkhead.agent.collectors.training import MAX_WORKERS
from bulkhead.agent.service import Built, Sources, build
from bulkhead.agent.settings import AgentSettings
from bulkhead.api.protocol import (
    AGENT_TOKEN_ENV,
    AGENT_URL_ENV,
    JOB_ENV,
    WorkerReport,
    job_report_token,
)
from bulkhead.trainer.runtime.node_agent import NodeAgentReporter

AUTH = {"Authorization": f"Bearer {TOKEN}"}  # the agents' own token: /v1/anomalies
JOB = "team-a.llm"
REPORT = f"/v1/jobs/{JOB}/report"
JOB_AUTH = {"Authorization": f"Bearer {job_report_token(TOKEN, JOB)}"}  # that job's reports


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(
    settings: AgentSettings, port: int | None = None
) -> Iterator[tuple[Built, httpx.Client]]:
    built = build(settings, Sources(gpu=None, kernel_log=None, api=None, host=True))
    stop = threading.Event()
    loop = threading.Thread(target=built.agent.run, args=(stop, settings.interval_s), daemon=True)
    port = port or _free_port()
    server = uvicorn.Server(
        uvicorn.Config(built.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    loop.start()
    thread.start()
    wait_until(lambda: server.started, "the HTTP server", timeout=30)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        yield built, http
    server.should_exit = True
    stop.set()
    thread.join(timeout=10)
    loop.join(timeout=10)


@pytest.fixture
def served() -> Iterator[tuple[Built, httpx.Client]]:
    with _serve(AgentSettings(**TEST_SETTINGS, interval_s=0.05)) as pair:
        yield pair


def test_probes_and_metrics(served):
    _, http = served
    wait_until(lambda: http.get("/readyz").status_code == 200, "readiness", timeout=30)
    assert http.get("/healthz").json() == {"status": "ok"}
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert "bulkhead_agent_ticks_total" in metrics.text
    assert "bulkhead_agent_tick_duration_seconds_bucket" in metrics.text


def test_nan_report_becomes_an_anomaly(served):
    _, http = served
    body = b'{"worker": "job-w3", "step": 12, "loss": NaN, "stepTimeS": 0.5}'
    reply = http.post(
        REPORT, content=body, headers={**JOB_AUTH, "content-type": "application/json"}
    )
    assert reply.status_code == 202, reply.text

    def anomaly() -> dict | None:
        data = http.get("/v1/anomalies", headers=AUTH).json()
        return data if data["condition"]["status"] == "True" else None

    wait_until(lambda: anomaly() is not None, "the NanLoss condition", timeout=30)
    data = anomaly()
    assert data["node"] == "test-node"
    assert data["condition"]["reason"] == "NanLoss"
    assert [(p["reason"], p["subject"]) for p in data["problems"]] == [("NanLoss", f"{JOB}/job-w3")]


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({}, b'{"worker": "w", "step": 1}', 401),
        ({"Authorization": "Bearer wrong"}, b'{"worker": "w", "step": 1}', 403),
        ({"Authorization": "Basic abc"}, b'{"worker": "w", "step": 1}', 401),
        # The agents' own token, or another job's, does not speak for this job.
        (AUTH, b'{"worker": "w", "step": 1}', 403),
        (
            {"Authorization": f"Bearer {job_report_token(TOKEN, 'team-b.llm')}"},
            b'{"worker": "w", "step": 1}',
            403,
        ),
        (JOB_AUTH, b"{not json", 422),
        (JOB_AUTH, b'{"worker": "w"}', 422),  # step missing
        (JOB_AUTH, b'{"worker": "w", "step": -1}', 422),
        (JOB_AUTH, b'{"worker": "", "step": 1}', 422),
        (JOB_AUTH, b'{"worker": "w", "step": 1, "stepTimeS": NaN}', 422),
        (JOB_AUTH, b'{"worker": "w", "step": 1, "surprise": true}', 422),
        (JOB_AUTH, b"[1, 2, 3]", 422),
        (JOB_AUTH, b'{"worker": "w", "step": 1, "pad": "' + b"x" * 70_000 + b'"}', 413),
    ],
)
def test_bad_reports_get_4xx_and_the_agent_keeps_running(served, headers, body, status):
    built, http = served
    reply = http.post(REPORT, content=body, headers={**headers, "content-type": "application/json"})
    assert reply.status_code == status, reply.text
    assert "detail" in reply.json()
    ticks = built.metrics.ticks._value.get()
    wait_until(lambda: built.metrics.ticks._value.get() > ticks + 2, "more ticks", timeout=30)
    assert http.get("/healthz").status_code == 200
    assert built.agent.problems() == []
    assert built.metrics.reports.labels("rejected")._value.get() >= 1


def test_reports_are_refused_without_a_configured_token():
    settings = AgentSettings(**{**TEST_SETTINGS, "report_token": None, "interval_s": 0.05})
    with _serve(settings) as (_, http):
        reply = http.post(REPORT, json={"worker": "w", "step": 1}, headers=JOB_AUTH)
    assert reply.status_code == 403
    assert "the agent has no token" in reply.json()["detail"]


def test_anomalies_need_the_token(served):
    _, http = served
    assert http.get("/v1/anomalies").status_code == 401
    wrong = http.get("/v1/anomalies", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    assert http.get("/v1/anomalies", headers=AUTH).status_code == 200


def test_the_trainers_reporter_reaches_the_agent(served):
    # The worker side (bulkhead.trainer.runtime.node_agent) against the real agent API.
    _, http = served
    url = str(http.base_url)
    assert NodeAgentReporter.from_env({}) is None  # local mode: nobody to report to
    env = {AGENT_URL_ENV: url, AGENT_TOKEN_ENV: job_report_token(TOKEN, JOB), JOB_ENV: JOB}
    reporter = NodeAgentReporter.from_env(env)
    assert reporter is not None
    reporter.post(WorkerReport(worker="job-w1", step=5, loss=2.5, step_time_s=0.2))
    reporter.post(WorkerReport(worker="job-w1", step=6, loss=float("nan"), step_time_s=0.2))
    reporter.close()
    assert reporter.sent == 2

    def problems() -> list[tuple[str, str]]:
        answer = http.get("/v1/anomalies", headers=AUTH).json()
        return [(p["reason"], p["subject"]) for p in answer["problems"]]

    wait_until(lambda: ("NanLoss", f"{JOB}/job-w1") in problems(), "NanLoss from the reporter", 30)


def test_same_named_workers_of_two_jobs_are_told_apart(served):
    """Jobs of one name in two namespaces put workers of one name on a node: each is
    watched on its own (one finishing does not end the other's watch)."""
    built, http = served
    for job in ("team-a.llm", "team-b.llm"):
        auth = {"Authorization": f"Bearer {job_report_token(TOKEN, job)}"}
        report = {"worker": "llm-w0-0", "step": 3}
        reply = http.post(f"/v1/jobs/{job}/report", json=report, headers=auth)
        assert reply.status_code == 202, reply.text
    done = {"worker": "llm-w0-0", "step": 4, "done": True}
    auth = {"Authorization": f"Bearer {job_report_token(TOKEN, 'team-a.llm')}"}
    assert http.post("/v1/jobs/team-a.llm/report", json=done, headers=auth).status_code == 202
    watched = built.agent.collectors.training.collect(built.agent.clock())
    assert [w.worker for w in watched] == ["team-b.llm/llm-w0-0"]


def test_the_reporter_survives_an_agent_that_refuses_it(served, caplog):
    _, http = served
    reporter = NodeAgentReporter(str(http.base_url), JOB, token="wrong")
    for step in range(3):
        reporter.post(WorkerReport(worker="job-w2", step=step))
    reporter.close()
    assert reporter.sent == 0
    # One warning for the outage, not one per report.
    assert caplog.text.count("node agent at") == 1


def test_a_chunked_flood_is_refused_as_it_streams(served):
    """100 MB in chunks (no Content-Length) on a raw socket: the agent answers 413 and
    hangs up after about MAX_REPORT_BYTES, long before the body ends (read whole, it
    peaked at 276 MB)."""
    built, http = served
    host, port = http.base_url.host, http.base_url.port
    chunk = b"x" * (1 << 20)
    total, sent, reply = 100 << 20, 0, b""
    with socket.create_connection((host, port), timeout=30) as sock:
        head = (
            f"POST {REPORT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: {JOB_AUTH['Authorization']}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        try:
            while sent < total:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the agent hung up: what we want
        with contextlib.suppress(OSError):
            reply = sock.recv(4096)
    assert sent < total // 4, f"{sent} bytes went out before the agent refused"
    assert not reply or reply.startswith(b"HTTP/1.1 413"), reply[:80]
    assert built.metrics.reports.labels("rejected")._value.get() >= 1
    assert http.get("/healthz").status_code == 200


def test_reports_of_too_many_unknown_workers_are_refused_known_ones_still_served(served):
    built, http = served
    headers = {**JOB_AUTH, "content-type": "application/json"}
    codes = [
        http.post(REPORT, content=f'{{"worker": "w{i}", "step": 1}}', headers=headers).status_code
        for i in range(MAX_WORKERS + 5)
    ]
    assert codes[:MAX_WORKERS] == [202] * MAX_WORKERS
    assert codes[MAX_WORKERS:] == [429] * 5
    again = http.post(REPORT, content='{"worker": "w0", "step": 2}', headers=headers)
    assert again.status_code == 202
    assert len(built.agent.collectors.training.collect(built.agent.clock())) == MAX_WORKERS


def test_a_rotated_agents_token_is_taken_without_a_restart(tmp_path, caplog):
    """The agents' token in a file (the mounted Secret the kubelet updates): after a
    rotation, pods made since report with the new derivation, pods made before with the
    old one; a second rotation retires the first token; unknown tokens stay refused."""
    token_file = tmp_path / "token"
    token_file.write_text("agents-token-1\n")
    settings = AgentSettings(
        **{**TEST_SETTINGS, "report_token": None, "report_token_file": token_file}
    )

    def report(http: httpx.Client, agents_token: str) -> int:
        auth = {"Authorization": f"Bearer {job_report_token(agents_token, JOB)}"}
        return http.post(REPORT, json={"worker": "w0", "step": 1}, headers=auth).status_code

    with caplog.at_level("WARNING"), _serve(settings) as (_, http):
        assert report(http, "agents-token-1") == 202
        token_file.write_text("agents-token-2\n")
        # Re-read at most every 5 s: the new token is refused until then, never longer.
        wait_until(lambda: report(http, "agents-token-2") == 202, "the rotated token taken")
        assert report(http, "agents-token-1") == 202  # a pod made before the rotation
        assert report(http, "made-up") == 403
        token_file.write_text("agents-token-3\n")
        wait_until(lambda: report(http, "agents-token-3") == 202, "the second rotation taken")
        assert report(http, "agents-token-2") == 202
        assert report(http, "agents-token-1") == 403  # two rotations ago: retired
        assert http.get(
            "/v1/anomalies", headers={"Authorization": "Bearer agents-token-3"}
        ).is_success
    assert sum("the agents' token was rotated" in r.message for r in caplog.records) == 2


def test_an_agent_restarted_mid_job_is_reported_to_again(caplog):
    """The node agent's pod restarts while a job trains: the trainer's reporter drops what
    it cannot send (one warning, training never waits), and the new agent on the same
    address watches the worker again from its next report."""
    settings = AgentSettings(**TEST_SETTINGS, interval_s=0.05)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    reporter = NodeAgentReporter(url, JOB, token=job_report_token(TOKEN, JOB))
    try:
        with _serve(settings, port):
            reporter.post(WorkerReport(worker="job-w3", step=1, loss=2.0, step_time_s=0.1))
            wait_until(lambda: reporter.sent == 1, "the first report delivered")
        with caplog.at_level("WARNING"):
            for step in range(2, 5):  # the agent is gone: dropped, never raised
                reporter.post(WorkerReport(worker="job-w3", step=step, loss=2.0))
            wait_until(lambda: "node agent at" in caplog.text, "the outage noticed")
        with _serve(settings, port) as (built, http):
            reporter.post(WorkerReport(worker="job-w3", step=5, loss=float("nan")))

            def problems() -> list[tuple[str, str]]:
                answer = http.get("/v1/anomalies", headers=AUTH).json()
                return [(p["reason"], p["subject"]) for p in answer["problems"]]

            wait_until(lambda: ("NanLoss", f"{JOB}/job-w3") in problems(), "NanLoss again", 30)
            watched = built.agent.collectors.training.collect(built.agent.clock())
            assert [w.worker for w in watched] == [f"{JOB}/job-w3"]
    finally:
        reporter.close()
    assert reporter.sent == 2  # the first agent's report and the new agent's
    assert caplog.text.count("node agent at") == 1  # one warning for the outage
