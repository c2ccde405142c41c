"""The pod relay and launcher of a multi-process worker pod, against a real control endpoint.

The G trainer processes of a pod speak the control protocol to their pod's relay; the
manager sees one member per pod: one registration (once all G are ready, with every
process's sidecar), one poller, one report of a fault all G saw. The launcher fails the
pod as a whole when one process exits with an error or falls silent. Real HTTP, real
processes (small Python programs stand in for the trainer processes, which need torch).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from control_harness import Harness

from bulkhead.api.client import ControlRequestError, ControlUnavailable, HttpControlClient
from bulkhead.api.protocol import (
    CHECKPOINT_SOCKET_ENV,
    ENDPOINT_ENV,
    JOB_ENV,
    LOCAL_RANK_ENV,
    SHM_DIR_ENV,
    TOKEN_ENV,
    WORKER_ENV,
    CompletionReport,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    WorkerExit,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Member
from bulkhead.trainer.pod.launcher import (
    PRESTART_NICE,
    STOP_TIMEOUT_S,
    PodLauncher,
    ServingRelay,
    child_env,
)
from bulkhead.trainer.pod.prestart import can_renice_back
from bulkhead.trainer.pod.relay import CachedView, PodRelay

JOB = "pods"
POD_CHILD = [sys.executable, str(Path(__file__).with_name("pod_child.py"))]
POD_LAUNCHER = [sys.executable, "-P", str(Path(__file__).with_name("pod_launcher.py"))]


def _spec(workers: int = 2) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "processesPerWorker": 2,
            "minWorkers": 1,
            "trainer": {"steps": 5},
            "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 60},
        }
    )


@pytest.fixture
def harness():
    with Harness(JOB, _spec()) as h:
        yield h


class Pod:
    """A relay served for pod ``worker`` and a control client per local rank."""

    def __init__(self, h: Harness, worker: str, poll_s: float = 5.0, port: int = 7000) -> None:
        self.worker = worker
        self.port = port  # of its store and (from 29700 + port) sidecars
        self.relay = PodRelay(h.url, h.token, JOB, worker, 2, poll_s=poll_s)
        self.serving = ServingRelay(self.relay)
        self.serving.start()
        self.url = f"http://127.0.0.1:{self.serving.port}"
        self.clients = [
            HttpControlClient(f"{self.url}/local/{i}", h.token, JOB, worker, retries=1)
            for i in range(2)
        ]

    def register(self, rank: int) -> None:
        self.clients[rank].register(
            RegisterRequest(
                worker=self.worker,
                node=f"node-{self.worker}",
                address=f"127.0.0.1:{self.port}" if rank == 0 else "",
                checkpoint_address=f"127.0.0.1:{22700 + self.port + rank}",
            )
        )

    def close(self) -> None:
        self.serving.stop()
        for client in self.clients:
            client.close()


@pytest.fixture
def pods(harness: Harness):
    made = [Pod(harness, f"{JOB}-w{slot}-0", port=7000 + 10 * slot) for slot in range(2)]
    yield made
    for pod in made:
        pod.close()


def _events(h: Harness, reason: str) -> list[str]:
    return [message for r, message, _ in h.driver.events if r == reason]


def test_a_pod_registers_once_all_its_processes_are_ready(harness: Harness, pods) -> None:
    h = harness
    a, b = pods
    a.register(0)
    b.register(0)
    b.register(1)
    # Pod b registered; pod a, one process short, did not, so no generation forms.
    assert b.relay.registered.wait(10) and b.relay.registration.ok
    assert a.relay.registration is None
    assert h.session.status.membership.generation == 0
    a.register(1)
    view = a.clients[1].membership(after=0, timeout_s=10)
    assert view.generation == 1
    assert [m.worker for m in view.members] == [a.worker, b.worker]
    # The pod's address is local rank 0's store; its sidecars are every process's.
    first = view.members[0]
    assert first.address == "127.0.0.1:7000"
    assert first.checkpoint_address == "127.0.0.1:29700,127.0.0.1:29701"
    assert first.checkpoint_addresses(2) == ["127.0.0.1:29700", "127.0.0.1:29701"]
    # Every process of both pods sees the same view through its relay.
    for pod in pods:
        for client in pod.clients:
            assert client.membership(after=0, timeout_s=10).generation == 1


def test_renewed_processes_see_only_generations_after_the_replaced_ones(
    harness: Harness, pods
) -> None:
    """After a restart in place the new processes register the pod again, and generation 1
    (the replaced processes') is not theirs to join: their polls wait for a newer one."""
    h = harness
    a, b = pods
    for pod in pods:
        pod.register(0)
        pod.register(1)
    assert a.clients[0].membership(after=0, timeout_s=10).generation == 1
    # The replaced local rank 0's long poll, still open in the relay when it is renewed.
    old = HttpControlClient(f"{a.url}/local/0", h.token, JOB, a.worker, retries=0)
    stale = threading.Thread(target=lambda: old.membership(after=1, timeout_s=20), daemon=True)
    stale.start()
    h.wait_for(lambda: a.relay._open_polls[0] == 1)
    a.relay.renew()
    assert a.relay.registration is None and not a.relay.registered.is_set()
    with pytest.raises(ControlUnavailable, match="503: no membership from the manager yet"):
        a.clients[1].membership(after=0, timeout_s=0.5)
    a.relay.report_pod_failure("local rank 1 died", kind="processes_restarted")
    stale.join(20)  # answered with generation 2 ...
    old.close()
    assert not stale.is_alive()
    # ... which is no sign of life of the new local rank 0 (else it is "silent" at once).
    assert [rank for rank, _ in a.relay.silent(0.0)] == [1]
    view = a.clients[1].membership(after=0, timeout_s=10)
    assert view.generation == 2 and [m.worker for m in view.members] == [b.worker]
    a.register(0)
    a.register(1)  # the pod registers again once both new processes checked in
    assert a.relay.registered.wait(10) and a.relay.registration.ok
    # The manager records the deferred join as it handles the registration, which may
    # finish after the relay has its answer.
    h.wait_for(lambda: any(a.worker in e for e in _events(h, "JoinDeferred")))


def test_a_fault_all_processes_saw_is_reported_once(harness: Harness, pods) -> None:
    h = harness
    for pod in pods:
        for rank in range(2):
            pod.register(rank)
    a = pods[0]
    assert a.clients[0].membership(after=0, timeout_s=10).generation == 1
    forwarded: list[str] = []
    original = a.relay.forward

    async def counting(rank: int, route: str, body: bytes):
        forwarded.append(route)
        return await original(rank, route, body)

    a.relay.forward = counting  # type: ignore[method-assign]
    report = FaultReport(worker=a.worker, generation=1, kind="collective_error", message="x")
    answers = []
    threads = [
        threading.Thread(target=lambda c=c: answers.append(c.fault(report))) for c in a.clients
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert len(answers) == 2 and answers[0] == answers[1]
    assert forwarded == ["faults"]  # one report reached the manager, for both processes
    h.wait_for(lambda: any(a.worker in m for m in _events(h, "FaultReported")))
    # A completion both processes report is one completion of the pod.
    done = CompletionReport(worker=a.worker, generation=1, step=4)
    assert a.clients[0].complete(done) == a.clients[1].complete(done)
    assert forwarded == ["faults", "complete"]


def test_the_pod_reports_the_oldest_persisted_step_of_its_processes(harness: Harness, pods) -> None:
    for pod in pods:
        for rank in range(2):
            pod.register(rank)
    a = pods[0]
    assert a.clients[0].membership(after=0, timeout_s=10).generation == 1
    seen: list[int | None] = []
    original = a.relay.forward

    async def recording(rank: int, route: str, body: bytes):
        seen.append(json.loads(body).get("persistedStep"))
        return await original(rank, route, body)

    a.relay.forward = recording  # type: ignore[method-assign]
    a.clients[1].progress(ProgressReport(worker=a.worker, generation=1, step=3, persisted_step=2))
    a.clients[0].progress(ProgressReport(worker=a.worker, generation=1, step=3, persisted_step=3))
    assert seen == [2, 2]  # rank 1 has persisted only step 2: the pod has


def test_bad_requests_are_refused_with_the_reason(harness: Harness, pods) -> None:
    a = pods[0]
    with httpx.Client(base_url=a.url) as http:
        unauthorized = http.post(f"/local/0/v1/jobs/{JOB}/register", json={"worker": a.worker})
        assert unauthorized.status_code == 401
        auth = {"Authorization": f"Bearer {harness.token}"}
        beyond = http.post(f"/local/2/v1/jobs/{JOB}/register", json={}, headers=auth)
        assert beyond.status_code == 404
        other = http.post(
            f"/local/0/v1/jobs/{JOB}/register", json={"worker": "someone-else"}, headers=auth
        )
        assert other.status_code == 422 and "not this pod" in other.json()["error"]
    with pytest.raises(ControlRequestError) as refused:
        a.clients[0].membership(after=-1, timeout_s=1)
    assert refused.value.status_code == 422


def test_a_process_that_stops_polling_is_silent(harness: Harness, pods) -> None:
    a = pods[0]
    a.register(0)
    a.register(1)
    unavailable: list[ControlUnavailable] = []

    def poll() -> None:
        # Pod b never registers, so no generation forms: the relay answers 503 at the
        # poll's end, and the client's retry does the same.
        try:
            a.clients[0].membership(after=5, timeout_s=3)
        except ControlUnavailable as exc:
            unavailable.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    later = time.monotonic() + 1.0

    def silent_ranks() -> list[int]:
        return [rank for rank, _ in a.relay.silent(limit_s=0.5, now=later)]

    # Rank 0 has an open poll (alive however long ago it asked); rank 1 has said nothing
    # since it registered, a second ago as seen from ``later``.
    harness.wait_for(lambda: silent_ranks() == [1], timeout=5)
    a.relay.forget(1)  # an exited process is no longer watched
    assert silent_ranks() == []
    poller.join(30)
    assert not poller.is_alive()
    assert len(unavailable) == 1 and "no membership from the manager yet" in str(unavailable[0])


def test_a_stopping_relay_answers_the_polls_still_open(harness: Harness, pods) -> None:
    # A pod whose process failed ends its relay while a poll is open (the failed process's,
    # up to the trainer's poll timeout). The relay answers it at once rather than leaving
    # the server's shutdown to wait it out or cut it off: the job's recovery waits for the
    # pod to end.
    a = pods[0]
    a.register(0)
    a.register(1)
    answers: list[httpx.Response] = []

    def poll() -> None:
        with httpx.Client(base_url=a.url, timeout=60) as http:
            answers.append(
                http.get(
                    f"/local/0/v1/jobs/{JOB}/membership",
                    params={"after": 10_000, "timeout": 30},
                    headers={"Authorization": f"Bearer {harness.token}"},
                )
            )

    poller = threading.Thread(target=poll)
    poller.start()
    # Open once rank 0 is no longer silent (rank 1 has not polled at all).
    harness.wait_for(lambda: [rank for rank, _ in a.relay.silent(limit_s=0.0)] == [1], timeout=5)
    started = time.monotonic()
    a.serving.stop()
    poller.join(30)
    assert not poller.is_alive()
    assert time.monotonic() - started < 10  # long before the poll's own 30 s
    assert [r.status_code for r in answers] == [503]
    assert "stopping" in answers[0].json()["error"]


def test_each_process_gets_its_rank_its_relay_and_its_own_sidecar_directory() -> None:
    env = {SHM_DIR_ENV: "/dev/shm/pod", CHECKPOINT_SOCKET_ENV: "/dev/shm/pod/checkpointd.sock"}
    got = child_env(env, 1, "http://127.0.0.1:5000", processes=2)
    assert got[LOCAL_RANK_ENV] == "1"
    assert got[ENDPOINT_ENV] == "http://127.0.0.1:5000/local/1"
    assert got[SHM_DIR_ENV] == "/dev/shm/pod/rank-1"
    assert got[CHECKPOINT_SOCKET_ENV] == "/dev/shm/pod/rank-1/checkpointd.sock"
    # The one process of a pod uses the pod's sidecar as a process run without a launcher.
    only = child_env(env, 0, "http://127.0.0.1:5000", processes=1)
    assert only[LOCAL_RANK_ENV] == "0" and only[ENDPOINT_ENV] == "http://127.0.0.1:5000/local/0"
    assert only[SHM_DIR_ENV] == env[SHM_DIR_ENV]
    assert only[CHECKPOINT_SOCKET_ENV] == env[CHECKPOINT_SOCKET_ENV]


def test_a_pod_trains_once_it_stayed_in_a_running_generation_and_not_in_a_replaced_one() -> None:
    relay = PodRelay("http://127.0.0.1:1", "t", JOB, f"{JOB}-w0-0", 2, poll_s=1.0)

    def seen(generation: int, at: float, workers: list[str]) -> CachedView:
        members = [Member(rank=i, worker=w, address="a:1") for i, w in enumerate(workers)]
        view = MembershipView(generation=generation, state="running", members=members)
        return CachedView(view, b"", f"g{generation}", f"{JOB}-w0-0" in workers, at)

    assert not relay.trains(10.0, now=1000.0)  # no generation yet
    relay._view = seen(3, 100.0, [f"{JOB}-w0-0", f"{JOB}-w1-0"])
    assert not relay.trains(10.0, now=105.0) and relay.trains(10.0, now=110.0)
    relay.renew()  # the pre-started processes took over: generation 3 was the old ones'
    assert not relay.trains(10.0, now=200.0)
    relay._view = seen(4, 200.0, [f"{JOB}-w1-0"])  # the others, without the pod
    assert not relay.trains(10.0, now=300.0)
    relay._view = seen(5, 300.0, [f"{JOB}-w1-0", f"{JOB}-w0-0"])  # joined again
    assert relay.trains(10.0, now=310.0)


def test_a_restarting_generation_naming_the_pod_asks_it_once_to_restart_in_place() -> None:
    """The manager's instruction (a hang or NaN restart) is a ``restarting`` generation
    naming the pod; once the launcher renewed its processes, the same one asks no more."""
    relay = PodRelay("http://127.0.0.1:1", "t", JOB, f"{JOB}-w0-0", 2, poll_s=1.0)

    def seen(generation: int, state: str, workers: list[str]) -> CachedView:
        members = [Member(rank=i, worker=w, address="a:1") for i, w in enumerate(workers)]
        view = MembershipView(generation=generation, state=state, members=members)
        return CachedView(view, b"", f"g{generation}-{state}", f"{JOB}-w0-0" in workers, 0.0)

    both = [f"{JOB}-w0-0", f"{JOB}-w1-0"]
    relay._view = seen(3, "running", both)
    assert relay.restart_requested() is None
    relay._view = seen(4, "restarting", [f"{JOB}-w1-0"])  # another pod's instruction
    assert relay.restart_requested() is None
    relay._view = seen(4, "restarting", both)
    requested = relay.restart_requested()
    assert requested is not None and requested.generation == 4
    relay.renew()  # the launcher switched processes: the new ones never see generation 4
    assert relay.restart_requested() is None
    relay._view = seen(5, "running", both)
    assert relay.restart_requested() is None


# ------------------------------------------------------------------ the launcher


def _launcher(
    h: Harness, worker: str, behaviours: list[str], silence_s: float = 30.0
) -> PodLauncher:
    """Pod ``worker``'s launcher, its processes stand-ins doing ``behaviours``."""
    env = {
        **os.environ,
        ENDPOINT_ENV: h.url,
        TOKEN_ENV: h.token,
        JOB_ENV: JOB,
        WORKER_ENV: worker,
        "POD_CHILD_BEHAVIOURS": ",".join(behaviours),
    }
    relay = PodRelay(h.url, h.token, JOB, worker, len(behaviours), poll_s=2.0)
    return PodLauncher(env, relay, silence_s, command=POD_CHILD)


def _launch(h: Harness, worker: str, behaviours: list[str], silence_s: float = 30.0) -> int:
    launcher = _launcher(h, worker, behaviours, silence_s)
    code = launcher.run()
    assert all(child.poll() is not None for child in launcher.children), "a process outlived"
    return code


def _other_pod(h: Harness) -> Pod:
    """Pod w1 registered and polling, so that generation 1 forms (its relay keeps the
    pod's member credential after the poll ends)."""
    pod = Pod(h, f"{JOB}-w1-0", port=7010)
    pod.register(0)
    pod.register(1)

    def poll() -> None:
        try:
            pod.clients[0].membership(after=0, timeout_s=20)
        finally:
            pod.close()

    threading.Thread(target=poll, daemon=True).start()
    return pod


def test_the_pod_ends_when_every_process_finished(harness: Harness) -> None:
    _other_pod(harness)
    assert _launch(harness, f"{JOB}-w0-0", ["exit:0", "exit:0"]) == WorkerExit.DONE


def test_one_process_failing_fails_the_pod_and_kills_the_others(harness: Harness) -> None:
    _other_pod(harness)
    started = time.monotonic()
    code = _launch(harness, f"{JOB}-w0-0", ["poll", "exit:7"])
    assert code == 1  # not a WorkerExit code: infrastructure, replace the pod
    assert time.monotonic() - started < 20  # the polling sibling was killed, not awaited


def test_a_user_error_in_one_process_is_the_pods(harness: Harness) -> None:
    _other_pod(harness)
    assert _launch(harness, f"{JOB}-w0-0", ["poll", "exit:2"]) == WorkerExit.USER_ERROR


def test_a_stopped_process_fails_the_pod_after_the_silence_limit(harness: Harness) -> None:
    _other_pod(harness)
    started = time.monotonic()
    code = _launch(harness, f"{JOB}-w0-0", ["poll", "stop"], silence_s=1.5)
    assert code == 1
    assert 1.5 <= time.monotonic() - started < 20


def test_sigterm_stops_every_process(harness: Harness) -> None:
    _other_pod(harness)
    launcher = _launcher(harness, f"{JOB}-w0-0", ["poll", "poll"])
    threading.Timer(3.0, launcher.terminate).start()
    assert launcher.run() == WorkerExit.STOPPED
    codes = [child.returncode for child in launcher.children]
    assert codes == [-signal.SIGTERM, -signal.SIGTERM] or codes == [
        WorkerExit.STOPPED,
        WorkerExit.STOPPED,
    ], codes


def test_a_pod_the_manager_refuses_stops_its_processes(harness: Harness) -> None:
    # No slot of the job has this id (a pod the manager already replaced, say).
    code = _launch(harness, f"{JOB}-w7-3", ["poll", "poll"])
    assert code == WorkerExit.STOPPED


def test_a_pod_whose_process_is_killed_ends_once_its_failure_is_reported(
    harness: Harness,
) -> None:
    # A launcher process as the worker runs it; one trainer process SIGKILLed (a crashed
    # GPU process). The other pods' recovery starts when this pod's process exits, so it
    # must end once the failure is reported, not after its relay's server has shut down
    # gracefully: that wait was bounded by STOP_TIMEOUT_S, so a pod that ends before that
    # bound, counted from the kill (the report and the sibling's kill included), did not
    # wait it out. (Measured on this 2-core machine at load 20: the exit came 0.5-0.6 s
    # after the report with the wait, a few ms without; not asserted, being timing.)
    h = harness
    _other_pod(h)
    worker = f"{JOB}-w0-0"
    env = {
        **os.environ,
        ENDPOINT_ENV: h.url,
        TOKEN_ENV: h.token,
        JOB_ENV: JOB,
        WORKER_ENV: worker,
        "POD_CHILD_BEHAVIOURS": "poll,poll",
    }
    launcher = subprocess.Popen(POD_LAUNCHER, env=env)
    try:
        h.wait_for(lambda: h.session.status.membership.generation == 1, timeout=60)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 2, children
        victim = _local_rank_1(children)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = launcher.wait(60)
        ended = time.monotonic() - killed
    finally:
        launcher.kill()
        launcher.wait()
    assert code == 1
    assert ended < STOP_TIMEOUT_S, f"the pod ended {ended:.2f}s after the kill"
    # ... and its failure was reported before it ended, not lost with it.
    reports = [m for m in _events(h, "FaultReported") if worker in m]
    assert reports and "local rank 1 exited with signal SIGKILL" in reports[0], reports


def _local_rank_1(pids: list[str]) -> int:
    for pid in pids:
        if f"{LOCAL_RANK_ENV}=1".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no local rank 1 among {pids}")


@pytest.mark.parametrize("processes", [2, 1])
def test_a_killed_process_is_replaced_in_place_by_processes_forked_from_the_template(
    harness: Harness, processes: int
) -> None:
    """Real processes: a launcher of 2 local ranks (or 1: a Kubernetes pod of one process)
    starts its template once its pod trains; one trainer process is SIGKILLed; processes
    forked from the template (started before the kill) take over as the launcher's own
    children, the pod leaves generation 2 and joins generation 3 under the same worker id,
    and no pod is stopped or started."""
    h = harness
    other = _other_pod(h)
    worker = f"{JOB}-w0-0"
    launcher = _launcher(h, worker, ["poll"] * processes)
    launcher.template_command = [*POD_CHILD, "--template"]
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(launcher.run()), daemon=True)
    runner.start()
    try:
        h.wait_for(lambda: h.session.status.membership.generation == 1, timeout=60)
        # The manager may publish the generation before the pod's registration answer (its
        # member credential) is back in the relay; the pod's processes see the generation
        # through the relay's poll, which names the pod only once registered.
        h.wait_for(launcher.relay.registered.is_set, timeout=60)
        assert launcher.template is None  # none before the pod trains: a start needs the CPU
        rank0 = HttpControlClient(f"{launcher._relay_url}/local/0", h.token, JOB, worker, retries=1)
        rank0.progress(ProgressReport(worker=worker, generation=1, step=0, loss=1.0))
        rank0.close()
        h.wait_for(lambda: launcher.template is not None, timeout=60)
        template = launcher.template
        assert template is not None
        template_nice = psutil.Process(template.pid).nice()
        template_started = psutil.Process(template.pid).create_time()
        first = [child.pid for child in launcher.children]
        victim = launcher.children[-1]
        killed_at = time.time()
        victim.kill()
        # The survivor (pod w1) recovers in generation 2 without the pod and trains a step.
        h.wait_for(lambda: h.session.status.membership.generation == 2, timeout=60)
        members = [m.worker for m in h.session.status.membership.members]
        assert members == [f"{JOB}-w1-0"]
        # Pod w1's trainer reports in its own name, with its pod's member credential.
        survivor = HttpControlClient(
            h.url, h.token, JOB, f"{JOB}-w1-0", retries=1, member=other.relay.member
        )
        h.wait_for(lambda: _events(h, "JoinDeferred"), timeout=60)  # re-registered
        survivor.progress(ProgressReport(worker=f"{JOB}-w1-0", generation=2, step=0, loss=1.0))
        survivor.close()
        h.wait_for(lambda: h.session.status.membership.generation == 3, timeout=60)
        rejoined = [m.worker for m in h.session.status.membership.members]
        now = [child.pid for child in launcher.children]
        parents = [psutil.Process(pid).ppid() for pid in now]
        working_nice = [psutil.Process(pid).nice() for pid in now]
    finally:
        launcher.terminate()
        runner.join(60)
    assert sorted(rejoined) == [f"{JOB}-w0-0", f"{JOB}-w1-0"]
    assert len(now) == processes and not set(now) & set(first)
    assert parents == [os.getpid()] * processes  # the launcher's children, not the template's
    assert template_started < killed_at, "the template started after the kill"
    # The template imports at a lower priority (its CPU is a start's or a recovery's); its
    # processes at work have the launcher's.
    own = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(19, own + PRESTART_NICE) if can_renice_back() else own
    assert template_nice == lowered and working_nice == [own] * processes
    assert launcher.restarts == 1 and h.driver.started == [f"{JOB}-w0-0", f"{JOB}-w1-0"]
    assert h.driver.stopped == []
    assert any("pre-started processes take over" in m for m in _events(h, "WorkerRestarted"))
    assert codes == [WorkerExit.STOPPED]
    assert all(p.poll() is not None for p in launcher.children)
    assert not template.alive()
