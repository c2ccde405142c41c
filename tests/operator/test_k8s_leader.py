"""Two operator replicas on the real API server: exactly one leads, and when it is killed in
the middle of a recovery the standby takes the Lease, serves the workers on the same
address (as the Service would route them) and the job converges."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from k8s_operator_harness import (
    FakeWorker,
    Job,
    OperatorProcess,
    ensure_crd,
    free_port,
    job_manifest,
    members,
    wait_until,
)
from test_k8s_operator import _form_generation, _set_anomaly

from bulkhead.operator.k8s.kube import KubeClient, load_credentials
from bulkhead.operator.k8s.leader import ElectionSettings, LeaderElector

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

FAST_LEASE = ["--lease-duration=4", "--renew-deadline=3", "--retry-period=0.5"]


def holder(k8s_cluster, namespace: str, lease: str = "bulkhead-operator") -> str:
    got = k8s_cluster.get_json("lease", lease, "-n", namespace)
    return got["spec"].get("holderIdentity") or ""


def test_electors_take_turns_and_only_one_wins_a_race(k8s_cluster, k8s_namespace) -> None:
    async def scenario() -> list[str]:
        client = KubeClient(load_credentials(k8s_cluster.kubeconfig))
        name = f"race-{uuid.uuid4().hex[:6]}"

        def elector(identity: str) -> LeaderElector:
            settings = ElectionSettings(k8s_namespace, name, identity, 2.0, 1.5, 0.2)
            return LeaderElector(client, settings)

        a, b, c = elector("a"), elector("b"), elector("c")
        stop = asyncio.Event()
        # Three candidates at once: one creates the lease, the others wait.
        results = await asyncio.gather(*(e._try() for e in (a, b, c)))
        winners = [e.settings.identity for e, won in zip((a, b, c), results, strict=True) if won]
        first = winners[0]
        leader = {"a": a, "b": b, "c": c}[first]
        keeping = asyncio.create_task(leader.keep(stop))
        others = [e for e in (a, b, c) if e is not leader]
        # While the leader renews, nobody else gets in, for longer than a lease.
        blocked = [asyncio.create_task(e.acquire(stop)) for e in others]
        done, _ = await asyncio.wait(blocked, timeout=3.0)
        assert not done, "a standby took a lease its holder kept renewing"
        # The leader dies (stops renewing): exactly one standby takes over.
        keeping.cancel()
        done, pending = await asyncio.wait(blocked, timeout=10.0, return_when="FIRST_COMPLETED")
        assert len(done) == 1
        second = next(e for e, t in zip(others, blocked, strict=True) if t in done)
        # It renews now; the last one keeps waiting.
        keeper = asyncio.create_task(second.keep(stop))
        _, still = await asyncio.wait(pending, timeout=3.0)
        assert still == pending
        # A clean shutdown hands the lease over at once.
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        assert await second.release()
        done, _ = await asyncio.wait(pending, timeout=1.5)  # less than a lease: handed over
        third = next(e for e, t in zip(others, blocked, strict=True) if t in done)
        stop.set()
        await client.close()
        return [first, second.settings.identity, third.settings.identity]

    order = asyncio.run(scenario())
    assert sorted(order) == ["a", "b", "c"]  # each one led in turn, never two at once


@pytest.fixture
def zone(k8s_cluster) -> Iterator[str]:
    name = f"z-{uuid.uuid4().hex[:6]}"
    nodes = k8s_cluster.add_gpu_nodes(3, prefix=f"ha-{name}", zone=name)
    try:
        yield name
    finally:
        k8s_cluster.delete_nodes(nodes)


@pytest.fixture
def replicas(k8s_cluster, k8s_namespace, tmp_path: Path) -> Iterator[list[OperatorProcess]]:
    ensure_crd(k8s_cluster)
    port = free_port()
    procs = [
        OperatorProcess(
            k8s_cluster.kubeconfig,
            k8s_namespace,
            tmp_path / f"operator-{who}.log",
            "--leader-elect",
            f"--leader-election-namespace={k8s_namespace}",
            f"--leader-election-identity=operator-{who}",
            *FAST_LEASE,
            port=port,
            health_port=free_port(),
        )
        for who in ("a", "b")
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()
            print(proc.logs()[-10000:])


def test_the_standby_takes_over_mid_recovery_and_the_job_converges(
    k8s_cluster, k8s_namespace, zone, replicas
) -> None:
    first, second = replicas
    first.start()
    wait_until(lambda: holder(k8s_cluster, k8s_namespace) == "operator-a", "a leads")
    second.start()
    # The exact phrase: the namespace, named after this test, also contains "standby".
    wait_until(lambda: "operator-b waits as a standby" in second.logs(), "b reports standby")

    job = Job(k8s_cluster, k8s_namespace, "ha")
    k8s_cluster.kubectl("apply", "-f", "-", input=job_manifest("ha", k8s_namespace, zone, 2))
    workers = _form_generation(job, first, 2)
    anyone = next(iter(workers.values()))
    gen1 = wait_until(lambda: (v := anyone.membership(0)) and v["generation"] >= 1 and v, "gen 1")
    assert holder(k8s_cluster, k8s_namespace) == "operator-a"  # b never acted

    victim = min(workers)
    survivor = next(w for w in workers.values() if w.id != victim)
    _set_anomaly(k8s_cluster, workers[victim].node)
    shrunk = wait_until(
        lambda: (s := job.status()) and s["membership"]["generation"] > gen1["generation"] and s,
        "the shrunk generation written to status",
    )

    first.kill()  # mid-recovery: the replacement has not registered
    wait_until(lambda: holder(k8s_cluster, k8s_namespace) == "operator-b", "b takes the lease")
    token = job.token()

    def register_replacement() -> FakeWorker | None:
        for name, pod in job.running_pods().items():
            if name in workers:
                continue
            candidate = FakeWorker(second.url, job, token, pod)
            try:
                candidate.register()
            except Exception:
                candidate.close()
                continue
            return candidate
        return None

    newcomer = wait_until(register_replacement, "a replacement accepted by the new leader")
    # The survivors train a step in their generation; then the deferred replacement joins.
    current = survivor.membership(0)["generation"]
    assert current >= shrunk["membership"]["generation"]
    survivor.progress(current, step=1)
    after = current
    grown = wait_until(
        lambda: (
            (v := survivor.membership(after)) and members(v) == {survivor.id, newcomer.id} and v
        ),
        "the scale-up generation from the new leader",
    )
    for worker in (survivor, newcomer):
        assert worker.progress(grown["generation"], step=5)["action"] == "continue"
    status = wait_until(
        lambda: (s := job.status()) and s["phase"] == "Running" and s, "status converges"
    )
    assert status["membership"]["generation"] == grown["generation"]
    slots = [p["metadata"]["labels"]["bulkhead.dev/slot"] for p in job.running_pods().values()]
    assert sorted(slots) == ["0", "1"]  # nothing duplicated by the handover
    assert "took the lease from operator-a" in second.logs()


def test_a_rolling_update_hands_every_job_over_without_restarting_any(
    k8s_cluster, k8s_namespace, zone, replicas
) -> None:
    """A rolling update of the operator Deployment: the new replica starts as a standby,
    the old one gets SIGTERM, and the new one takes the Lease and adopts every running job
    from the API server. No job restarts or re-forms: the same pods, the same generation,
    the workers' credentials (issued by the old replica) still accepted, training goes on."""
    old, new = replicas
    old.start()
    wait_until(lambda: holder(k8s_cluster, k8s_namespace) == "operator-a", "a leads")
    names = ["roll-a", "roll-b", "roll-c"]
    for name in names:
        manifest = job_manifest(name, k8s_namespace, zone, 2)
        k8s_cluster.kubectl("apply", "-f", "-", input=manifest)
    jobs = {name: Job(k8s_cluster, k8s_namespace, name) for name in names}
    workers = {name: _form_generation(job, old, 2) for name, job in jobs.items()}
    before: dict[str, tuple[int, dict[str, str]]] = {}
    for name, job in jobs.items():
        anyone = next(iter(workers[name].values()))
        view = wait_until(
            lambda w=anyone: (v := w.membership(0)) and v["generation"] >= 1 and v,
            f"{name}: its first generation",
        )
        for worker in workers[name].values():
            assert worker.progress(view["generation"], step=3)["action"] == "continue"
        pods = {p: pod["metadata"]["uid"] for p, pod in job.running_pods().items()}
        before[name] = (view["generation"], pods)

    new.start()
    wait_until(lambda: "operator-b waits as a standby" in new.logs(), "b waits as a standby")
    assert old.stop() == 0  # the old pod of the rolling update: SIGTERM, the Lease released
    wait_until(lambda: holder(k8s_cluster, k8s_namespace) == "operator-b", "b takes the lease")

    for name, job in jobs.items():
        generation, pods = before[name]
        wait_until(
            lambda n=name: f"job {k8s_namespace}/{n} resumed with 2 live pods" in new.logs(),
            f"{name} adopted by the new leader",
        )
        for worker in workers[name].values():
            answer = wait_until(
                lambda w=worker, g=generation: _progress_or_none(w, g, 7),
                f"{name}: {worker.id} reports to the new leader",
            )
            assert answer["action"] == "continue", answer
        status = wait_until(
            lambda j=job: (s := j.status()) and s.get("step") == 7 and s, f"{name}: step 7"
        )
        assert status["phase"] == "Running" and status.get("restarts", 0) == 0, status
        assert status["membership"]["generation"] == generation, status
        assert {p: pod["metadata"]["uid"] for p, pod in job.running_pods().items()} == pods


def _progress_or_none(worker: FakeWorker, generation: int, step: int) -> dict | None:
    """The new leader's answer, or None while the Service has no leader behind it."""
    try:
        return worker.progress(generation, step)
    except httpx.HTTPError:
        return None
