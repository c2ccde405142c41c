"""A deposed leader stops at once (issue 36, item 2), on the real API server.

Operator A reaches the API server through a TCP relay that this test can stall, as an
overloaded API server stalls a replica's requests; B reaches it directly. When A's
requests stall, A's renewals time out at its renew deadline, its writes are fenced off
from that moment (``NotLeading``), and it exits, before B, which must first see the Lease
unchanged for a whole lease duration, takes over. Before the fix A stepped down only when
its stalled call returned (10 s after B led, in the audit).
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from k8s_operator_harness import Job, OperatorProcess, ensure_crd, job_manifest, wait_until
from test_k8s_operator import _form_generation

from bulkhead.operator.k8s.kube import KubeClient, NotLeading, core_path, load_credentials
from bulkhead.operator.k8s.leader import ElectionSettings, LeaderElector

pytestmark = [pytest.mark.k8s]

# The margin between A's renew deadline (3 s) and the lease B must see expire (6 s) is
# what a loaded machine may delay A's exit by without the test failing.
LEASE = ["--lease-duration=6", "--renew-deadline=3", "--retry-period=0.5"]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class StallableRelay:
    """A TCP relay to ``target`` on its own thread; ``stall()`` stops moving bytes both
    ways while keeping every connection open (requests hang, as on a stuck server)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.flowing = threading.Event()
        self.flowing.set()
        self.loop = asyncio.new_event_loop()
        self.port = _listen_port()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> StallableRelay:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self.loop
        )
        self.server = started.result(10)
        return self

    def __exit__(self, *_: object) -> None:
        self.flowing.set()

        async def close() -> None:
            self.server.close()
            pipes = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def stall(self) -> None:
        self.flowing.clear()

    def flow(self) -> None:
        self.flowing.set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                while not self.flowing.is_set():
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))


def _listen_port() -> int:
    """A free port below the ephemeral range: the relay's many outgoing connections take
    ephemeral ports, and one of them could take a port ``free_port`` handed out before the
    operator that was to listen on it has started."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for candidate in random.sample(range(max(1024, low - 8000), low), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    raise RuntimeError("no free port below the ephemeral range")


def _kubeconfig_via(original: Path, port: int, out: Path) -> Path:
    config: dict[str, Any] = yaml.safe_load(original.read_text())
    for cluster in config["clusters"]:
        server = cluster["cluster"]["server"]
        cluster["cluster"]["server"] = re.sub(r":\d+$", f":{port}", server)
    out.write_text(yaml.safe_dump(config))
    return out


def _logged_at(logs: str, phrase: str) -> float:
    for line in logs.splitlines():
        if phrase in line and (match := STAMP.match(line)):
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError(f"{phrase!r} not in the log:\n{logs[-4000:]}")


def _api_server(kubeconfig: Path) -> tuple[str, int]:
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, port = re.match(r"https?://([^:/]+):(\d+)", server).groups()  # type: ignore[union-attr]
    return socket.gethostbyname(host), int(port)


@pytest.fixture
def relay(k8s_cluster) -> Iterator[StallableRelay]:
    with StallableRelay(_api_server(k8s_cluster.kubeconfig)) as relay:
        yield relay


def test_a_stalled_leader_is_fenced_and_gone_before_the_standby_leads(
    k8s_cluster, k8s_namespace, relay, tmp_path: Path
) -> None:
    ensure_crd(k8s_cluster)
    port = _listen_port()
    common = ["--leader-elect", f"--leader-election-namespace={k8s_namespace}", *LEASE]
    a = OperatorProcess(
        _kubeconfig_via(k8s_cluster.kubeconfig, relay.port, tmp_path / "a.kubeconfig"),
        k8s_namespace,
        tmp_path / "a.log",
        *common,
        "--leader-election-identity=operator-a",
        port=port,
        health_port=_listen_port(),
    )
    b = OperatorProcess(
        k8s_cluster.kubeconfig,
        k8s_namespace,
        tmp_path / "b.log",
        *common,
        "--leader-election-identity=operator-b",
        port=port,
        health_port=_listen_port(),
    )
    try:
        a.start()
        wait_until(lambda: "operator-a leads" in a.logs(), "a leads")
        b.start()
        wait_until(lambda: "operator-b waits as a standby" in b.logs(), "b is a standby")
        stalled_at = time.time()
        relay.stall()
        wait_until(lambda: not a.alive(), "a exits", timeout=60)
        wait_until(lambda: "took the lease from operator-a" in b.logs(), "b leads", timeout=60)
        assert a.proc is not None and a.proc.returncode == 1, a.logs()[-4000:]
        stepped_down = _logged_at(a.logs(), "stepping down")
        took_over = _logged_at(b.logs(), "took the lease from operator-a")
        # A stopped acting (its fence closes at the same deadline) before B started.
        assert stalled_at < stepped_down < took_over, (stalled_at, stepped_down, took_over)
        assert "leadership lost: exiting now" in a.logs()
    finally:
        for proc in (a, b):
            proc.stop()
            print(proc.logs()[-6000:])


def test_writes_are_refused_before_sending_once_the_fence_closes(k8s_cluster, k8s_namespace):
    """The fence is checked right before a write is sent; reads and the Lease pass."""

    async def scenario() -> tuple[bool, bool]:
        client = KubeClient(load_credentials(k8s_cluster.kubeconfig))
        elector = LeaderElector(
            client, ElectionSettings(k8s_namespace, "fence-lease", "me", 6.0, 0.5, 0.2)
        )
        stop = asyncio.Event()
        try:
            assert await elector.acquire(stop) and elector.is_leading()
            client.fence = elector.is_leading
            body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "while-leading"}}
            assert await client.create(core_path("configmaps", k8s_namespace), body)
            await asyncio.sleep(0.6)  # no renewal for longer than the renew deadline
            fenced = not elector.is_leading()
            late = {**body, "metadata": {"name": "after-the-deadline"}}
            with pytest.raises(NotLeading):
                await client.create(core_path("configmaps", k8s_namespace), late)
            listed = await client.list(core_path("configmaps", k8s_namespace))
            names = {c["metadata"]["name"] for c in listed}
            return fenced, names >= {"while-leading"} and "after-the-deadline" not in names
        finally:
            await client.close()

    fenced, only_the_first = asyncio.run(scenario())
    assert fenced and only_the_first


def test_an_operator_cut_off_from_the_api_server_stops_and_its_job_goes_on_after(
    k8s_cluster, k8s_namespace, relay, tmp_path: Path
) -> None:
    """The only operator replica loses the API server (its relay stalls) but not its
    workers: it stops leading and exits on its own (no Lease renewal within the renew
    deadline) instead of acting on a stale view. Restarted once the API server is back (as
    its Deployment restarts it), it resumes the job from the API server: the same pods and
    generation, the workers' credentials accepted, training goes on with no restart."""
    ensure_crd(k8s_cluster)
    zone = f"z-{uuid.uuid4().hex[:6]}"
    nodes = k8s_cluster.add_gpu_nodes(2, prefix=f"cut-{zone}", zone=zone)
    port = _listen_port()
    args = [
        "--leader-elect",
        f"--leader-election-namespace={k8s_namespace}",
        *LEASE,
        "--leader-election-identity=operator-a",
    ]
    kubeconfig = _kubeconfig_via(k8s_cluster.kubeconfig, relay.port, tmp_path / "a.kubeconfig")

    def operator(log: str) -> OperatorProcess:
        return OperatorProcess(
            kubeconfig, k8s_namespace, tmp_path / log, *args, port=port, health_port=_listen_port()
        )

    first, second = operator("first.log"), operator("second.log")
    try:
        first.start()
        k8s_cluster.kubectl("apply", "-f", "-", input=job_manifest("cut", k8s_namespace, zone, 2))
        job = Job(k8s_cluster, k8s_namespace, "cut")
        workers = _form_generation(job, first, 2)
        anyone = next(iter(workers.values()))
        view = wait_until(lambda: (v := anyone.membership(0)) and v["generation"] >= 1 and v, "gen")
        generation = view["generation"]
        for worker in workers.values():
            assert worker.progress(generation, step=4)["action"] == "continue"
        pods = {name: pod["metadata"]["uid"] for name, pod in job.running_pods().items()}

        relay.stall()
        wait_until(lambda: not first.alive(), "the cut-off operator exits", timeout=60)
        assert first.proc is not None and first.proc.returncode == 1
        assert "leadership lost: exiting now" in first.logs()

        relay.flow()
        second.start()
        wait_until(
            lambda: f"job {k8s_namespace}/cut resumed with 2 live pods" in second.logs(),
            "the restarted operator resumes the job",
        )
        for worker in workers.values():
            answer = wait_until(
                lambda w=worker: _progress_or_none(w, generation, 9), f"{worker.id} reports"
            )
            assert answer["action"] == "continue", answer
        status = wait_until(lambda: (s := job.status()) and s.get("step") == 9 and s, "step 9")
        assert status["phase"] == "Running" and status.get("restarts", 0) == 0, status
        assert status["membership"]["generation"] == generation, status
        assert {n: p["metadata"]["uid"] for n, p in job.running_pods().items()} == pods
    finally:
        relay.flow()
        for proc in (first, second):
            proc.stop()
            print(proc.logs()[-6000:])
        k8s_cluster.delete_nodes(nodes)


def _progress_or_none(worker: Any, generation: int, step: int) -> dict | None:
    """The operator's answer, or None while none is up behind the control address."""
    try:
        return worker.progress(generation, step)
    except httpx.HTTPError:  # refused, reset or unavailable while the operator is away
        return None
