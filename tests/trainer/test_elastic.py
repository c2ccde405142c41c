"""Elastic runtime across membership changes: real worker processes, real gloo groups.

One run exercises the whole life: a non-coordinator is killed (survivors re-form), a new
worker joins (it receives the state by broadcast), then the coordinator itself is killed
(the lowest surviving rank hosts the next rendezvous), and the job reaches its final step
with identical replicas and every sample consumed exactly once.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from elastic_harness import Manager, read_lines, tiny_spec, worker_main
from processes import preloaded_context

pytestmark = pytest.mark.slow

CTX = preloaded_context()
OPEN_ENDED = 100_000  # total steps while the test still has faults to inject


def _start(
    root: Path, worker: str, spec: dict, agent_url: str | None = None, slow_s: float = 0.0
) -> mp.Process:
    args = (str(root), worker, spec, agent_url, slow_s)
    proc = CTX.Process(target=worker_main, args=args, name=worker)
    proc.start()
    return proc


def _kill(proc: mp.Process) -> None:
    proc.kill()
    proc.join(30)
    assert proc.exitcode is not None and proc.exitcode < 0, "the victim did not die"


def test_survives_worker_loss_join_and_coordinator_loss(tmp_path: Path) -> None:
    spec = tiny_spec()
    mgr = Manager(tmp_path)
    procs = {w: _start(tmp_path, w, spec) for w in ("a", "b", "c")}
    try:
        mgr.wait("3 registrations", lambda: len(mgr.addresses()) == 3)
        g1 = mgr.publish(["a", "b", "c"], OPEN_ENDED)
        mgr.wait("progress in generation 1", lambda: mgr.max_step(g1.generation) >= 5)

        _kill(procs.pop("b"))  # rank 1 of 3
        g2 = mgr.publish(["a", "c"], OPEN_ENDED)
        mgr.wait("progress in generation 2", lambda: mgr.max_step(g2.generation) >= 0)

        procs["d"] = _start(tmp_path, "d", spec)
        mgr.wait("d registered", lambda: "d" in mgr.addresses())
        g3 = mgr.publish(["a", "c", "d"], OPEN_ENDED)
        mgr.wait("progress in generation 3", lambda: mgr.max_step(g3.generation) >= 3)

        _kill(procs.pop("a"))  # the coordinator
        at_loss = mgr.max_step()
        total = at_loss + 25
        g4 = mgr.publish(["c", "d"], total)
        for proc in procs.values():
            proc.join(120)
        assert all(p.exitcode == 0 for p in procs.values()), {
            w: p.exitcode for w, p in procs.items()
        }
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()

    # Survivors lost no step: generation 4 resumed right after the last step of generation 3
    # (at most the one step in flight when the coordinator died is redone).
    g4_steps = [p["step"] for p in mgr.progress() if p["generation"] == g4.generation]
    assert min(g4_steps) <= at_loss + 2
    assert max(g4_steps) == total - 1

    # Both final replicas are identical (state sync + deterministic all-reduce).
    finals = [torch.load(tmp_path / f"final-{w}.pt") for w in ("c", "d")]
    for name, tensor in finals[0].items():
        assert torch.equal(tensor, finals[1][name]), name

    # Every step was committed exactly once, so every stream position was consumed once.
    steps = [e["step"] for e in read_lines(tmp_path / "samples.jsonl")]
    assert sorted(steps) == list(range(total))
    positions = sorted(
        p for e in read_lines(tmp_path / "samples.jsonl") for p in range(*e["positions"])
    )
    assert positions == list(range(total * 10))

    # The newcomer trained in generation 3 from the survivors' state, not from scratch
    # (rank 0 reports for the generation: every rank completes the same steps).
    g3_first = min(p["step"] for p in mgr.progress() if p["generation"] == g3.generation)
    assert g3_first > 5
    assert {p["worker"] for p in mgr.progress()} <= {"a", "c"}  # only rank 0 reports

    losses = [p["loss"] for p in sorted(mgr.progress(), key=lambda p: p["step"])]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


def test_hung_peer_is_abandoned_without_waiting_for_the_collective_timeout(
    tmp_path: Path,
) -> None:
    import os
    import signal
    import time

    spec = tiny_spec()
    spec["faultTolerance"]["collectiveTimeoutSeconds"] = 600  # far beyond the test's deadline
    mgr = Manager(tmp_path)
    procs = {w: _start(tmp_path, w, spec) for w in ("a", "b", "c")}
    try:
        mgr.wait("3 registrations", lambda: len(mgr.addresses()) == 3)
        g1 = mgr.publish(["a", "b", "c"], OPEN_ENDED)
        mgr.wait("progress in generation 1", lambda: mgr.max_step(g1.generation) >= 5)
        assert procs["c"].pid is not None
        os.kill(procs["c"].pid, signal.SIGSTOP)  # c hangs: alive, silent, holding sockets
        hung_at = time.monotonic()
        stalled = mgr.max_step()
        g2 = mgr.publish(["a", "b"], stalled + 10)
        for w in ("a", "b"):
            procs[w].join(120)
            assert procs[w].exitcode == 0, w
        # Far below the 600 s collective timeout: the stuck all-reduce was abandoned.
        assert time.monotonic() - hung_at < 60
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
    g2_steps = sorted(p["step"] for p in mgr.progress() if p["generation"] == g2.generation)
    assert g2_steps[-1] == stalled + 9
    steps = sorted(e["step"] for e in read_lines(tmp_path / "samples.jsonl"))
    assert steps == list(range(stalled + 10))


class _NodeAgent(BaseHTTPRequestHandler):
    """Stands in for the node agent's ``POST /v1/jobs/{job}/report``: records what arrives."""

    reports: list[tuple[str, dict]] = []

    def do_POST(self) -> None:
        assert self.path == "/v1/jobs/elastic/report", self.path
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.reports.append((self.headers.get("Authorization", ""), body))
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def node_agent() -> Iterator[str]:
    """A stand-in node agent on 127.0.0.1; its reports are in ``_NodeAgent.reports``."""
    _NodeAgent.reports = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NodeAgent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def _run_to_end(
    tmp_path: Path, workers: list[str], steps: int, agent_url: str, slow: dict[str, float]
) -> None:
    """Train ``workers`` from the first step to ``steps``; ``slow`` workers sleep in forward."""
    mgr = Manager(tmp_path)
    spec = tiny_spec()
    procs = {w: _start(tmp_path, w, spec, agent_url, slow.get(w, 0.0)) for w in workers}
    try:
        mgr.wait("registrations", lambda: len(mgr.addresses()) == len(workers))
        mgr.publish(workers, steps)
        for proc in procs.values():
            proc.join(180)
            assert proc.exitcode == 0
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()


def _reports_of(worker: str) -> list[dict]:
    return [body for _, body in _NodeAgent.reports if body["worker"] == worker]


def test_workers_report_steps_and_completion_to_their_node_agent(
    tmp_path: Path, node_agent: str
) -> None:
    _run_to_end(tmp_path, ["a", "b"], 8, node_agent, slow={})
    for worker in ("a", "b"):
        mine = _reports_of(worker)
        steps = [body["step"] for body in mine if not body["done"]]
        assert steps == list(range(8)), steps  # every step (logIntervalSteps 1), in order
        assert all(body["stepTimeS"] > 0 and body["loss"] > 0 for body in mine[:-1])
        assert mine[-1]["done"] and mine[-1]["step"] == 7
    assert {auth for auth, _ in _NodeAgent.reports} == {"Bearer t"}


def test_a_straggler_keeps_telling_its_node_agent(tmp_path: Path, node_agent: str) -> None:
    # a is slow from the start: verdicts come every 20 steps, the first with patience 2.
    _run_to_end(tmp_path, ["a", "b", "c"], 70, node_agent, slow={"a": 0.05})
    flagged = [body["step"] for body in _reports_of("a") if body["stragglers"] == ["a"]]
    # Every report after the verdict repeats it (the agent escalates what persists).
    assert flagged and flagged == list(range(flagged[0], 70)), flagged
    assert all(0 < body["stragglerScores"]["a"] < 0.8 for body in _reports_of("a")[-5:-1])
    for fast in ("b", "c"):
        assert not any(body["stragglers"] for body in _reports_of(fast))
