"""Benchmark of the Kubernetes operator on KWOK GPU nodes: reaction to a bad node, job start.

For each size (10 / 100 / 1000 nodes) a job with one worker per node is applied and its
workers are played over the control protocol; then a node gets ``BulkheadAnomaly=True``:

- ``to_taint_s``: condition set -> node cordoned and tainted bulkhead.dev/unhealthy;
- ``to_generation_s``: condition set -> a survivor's long poll returns the new generation;
- ``to_replacement_running_s``: condition set -> the replacement pod Running on a spare node;
- ``job_running_s``: job applied -> all pods Running, workers registered, phase Running
  (``pods_running_s``: until the scheduler and KWOK have every pod Running;
  ``registered_s``: until every worker's registration was answered). Each played worker
  registers as soon as its own pod is Running, as a real one does when its container
  starts, so registrations overlap the creation and scheduling of the other pods.

Baseline, same run: creating the same number of pods one at a time (what an operator that
creates pods sequentially needs before any worker can even start): ``baseline_create_s``.
Operator cost, same run: its CPU seconds and its API requests by lane (the operator's
``/metrics``) from the job's creation to Running (``operator_start_*``) and from the
anomaly to the replacement Running (``operator_recovery_*``); in the same windows the CPU
seconds of each control-plane process (``..._cpu_s_kube-apiserver``; known when the bench
started the cluster or the kubeconfig sits next to a ``make cluster`` state file) and the
API server's requests by verb and resource (``..._writes_POST_pods/binding``), printed
as writes per worker pod.
Targets (issue 42), at 1000 nodes: tainted <= 1 s, new generation <= 1 s, replacement
Running <= 5 s, job Running <= 30 s.

    python bench/operator.py --quick --out bench-operator.json      # 10 nodes, < 60 s
    python bench/operator.py --sizes 10,100,1000 --kubeconfig ~/.cache/bulkhead/cluster/...
    python bench/operator.py --sizes 1000 --busy 1   # and again with one core taken
Without --kubeconfig a throw-away control plane is started (hack/k8s_cluster.py).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))

from k8s_control_plane import ControlPlane  # noqa: E402

from bulkhead.api.protocol import MEMBER_HEADER  # noqa: E402
from bulkhead.operator.k8s.kube import (  # noqa: E402
    KubeClient,
    KubeError,
    core_path,
    load_credentials,
    tj_path,
)
from bulkhead.operator.k8s.watch import CollectionWatch  # noqa: E402
from bulkhead.operator.local.children import end_children_on_exit  # noqa: E402

STRATEGIC = "application/strategic-merge-patch+json"
REGISTER_CONCURRENCY = 64  # workers registering at the same time
NODE_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION"}


def _node(name: str, zone: str, index: int) -> dict[str, Any]:
    resources = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8"}
    cidr = f"10.{200 + index // 256}.{index % 256}.0/24"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": zone,
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {"capacity": resources, "allocatable": resources},
    }


def _ready(node: dict[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def _until(check: Any, what: str, timeout: float, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (robust where wall time is noisy)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kube_requests(metrics_text: str) -> dict[str, float]:
    """The operator's API requests so far by lane (``bulkhead_operator_kube_requests_total``)
    and each lane's summed queue wait (``..._queue_wait_seconds_sum``)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        for metric, prefix in (
            ("bulkhead_operator_kube_requests_total{", "requests"),
            ("bulkhead_operator_kube_queue_wait_seconds_sum{", "wait_s"),
        ):
            if line.startswith(metric):
                lane = line.split('lane="', 1)[1].split('"', 1)[0]
                key = f"{prefix}_{lane}"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class PlayedWorkers:
    """The job's workers as they start on a real cluster: each registers over the control
    protocol as soon as its own pod is Running, while other pods are still being created
    and scheduled. Pods are followed by a watch, as the operator follows them, not by
    listing the whole job again and again (which would cost the API server more than what
    is measured)."""

    def __init__(self, http: httpx.AsyncClient, n: int, started: float) -> None:
        self.http = http
        self.n = n
        self.started = started
        self.pods: dict[str, dict[str, Any]] = {}
        self.registrations: list[asyncio.Task[None]] = []
        self.credentials: dict[str, str] = {}  # worker -> its member credential
        # At most as many in flight as connections: a thousand requests queued inside
        # httpx's pool cost this process more than the operator spends answering them.
        self.limit = asyncio.Semaphore(REGISTER_CONCURRENCY)
        self.running = asyncio.Event()
        self.newcomer = asyncio.Event()  # a pod Running after all n were (a replacement)
        self.all_running_s = 0.0
        self.all_registered_s = 0.0

    async def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if kind == "DELETED" or pod["metadata"].get("deletionTimestamp") or name in self.pods:
            return
        if (pod.get("status") or {}).get("phase") != "Running":
            return
        if self.running.is_set():
            self.newcomer.set()  # not registered: the measurement ends when it runs
            return
        self.pods[name] = pod
        self.registrations.append(asyncio.create_task(self._register(pod)))
        if len(self.pods) >= self.n and not self.running.is_set():
            self.all_running_s = time.perf_counter() - self.started
            self.running.set()

    async def all_registered(self) -> None:
        await self.running.wait()
        await asyncio.gather(*self.registrations)
        self.all_registered_s = time.perf_counter() - self.started

    async def _register(self, pod: dict[str, Any]) -> None:
        body = {
            "worker": pod["metadata"]["name"],
            "node": pod["spec"]["nodeName"],
            "address": f"{pod['status'].get('podIP', '127.0.0.1')}:29500",
            "claim": secrets.token_urlsafe(24),
        }
        # A kept-alive connection the endpoint closed as it was reused is retried: a
        # repeated registration of the same worker, address and claim is accepted.
        async with self.limit:
            answer = await _retrying_transport(lambda: self.http.post("/register", json=body))
        answer.raise_for_status()
        self.credentials[body["worker"]] = answer.json()["credential"]


def _api_requests(metrics_text: str) -> dict[str, float]:
    """The API server's requests so far by verb and resource (its own
    ``apiserver_request_total``): ``writes_PATCH_pods/status``, ``reads_LIST_nodes``."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        kind = "writes" if labels.get("verb") in WRITE_VERBS else "reads"
        key = f"{kind}_{labels.get('verb')}_{resource}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Bench:
    def __init__(
        self,
        kube: KubeClient,
        operator_url: str,
        operator_pid: int,
        server: httpx.AsyncClient,
        components: dict[str, int] | None = None,
    ) -> None:
        self.kube = kube
        self.url = operator_url
        self.pid = operator_pid
        self.server = server  # the API server, for its /metrics
        # The control plane's processes, when known: their CPU is counted per phase too
        # (on 2 cores, the job's start is bound by everyone's CPU, not the operator's).
        self.components = components or {}

    async def _counters(self) -> dict[str, float]:
        """CPU seconds so far (the operator's, each control-plane process's), the
        operator's API requests by lane and the API server's requests by verb/resource."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            text = (await http.get("/metrics")).text
        counters = {"cpu_s": _cpu_seconds(self.pid), **_kube_requests(text)}
        for name, pid in self.components.items():
            counters[f"cpu_s_{name}"] = _cpu_seconds(pid)
        server_metrics = (await self.server.get("/metrics")).text
        return {**counters, **_api_requests(server_metrics)}

    async def nodes(self, zone: str, names: list[str], offset: int) -> None:
        await asyncio.gather(
            *(
                self.kube.create(core_path("nodes"), _node(n, zone, offset + i))
                for i, n in enumerate(names)
            )
        )

        async def all_ready() -> bool:
            items = await self.kube.list(core_path("nodes"), f"topology.kubernetes.io/zone={zone}")
            ready = {n["metadata"]["name"] for n in items if _ready(n)}
            return set(names) <= ready

        await _until(all_ready, f"{len(names)} nodes Ready", 120, 0.3)

    async def baseline_create(self, ns: str, n: int) -> float:
        """n pods created one at a time (never scheduled, deleted afterwards).

        A scheduling gate keeps the scheduler from even trying them: an unschedulable pod
        costs a failed attempt over every node, a status write and a FailedScheduling
        Event, work that would spill into the measured job's start."""
        started = time.perf_counter()
        for i in range(n):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"seq-{i}", "labels": {"bench": "baseline"}},
                "spec": {
                    "schedulingGates": [{"name": "bulkhead.dev/bench-baseline"}],
                    "containers": [{"name": "c", "image": "x"}],
                },
            }
            await self.kube.create(core_path("pods", ns), pod)
        elapsed = time.perf_counter() - started
        pods = await self.kube.list(core_path("pods", ns), "bench=baseline")
        await asyncio.gather(
            *(self.kube.delete(core_path("pods", ns, p["metadata"]["name"]), 0) for p in pods)
        )
        return elapsed

    async def size(self, n: int, index_offset: int) -> dict[str, float]:
        tag = uuid.uuid4().hex[:5]
        zone, ns, job = f"bench-{n}-{tag}", f"bench-{n}-{tag}", "bench"
        names = [f"{zone}-{i}" for i in range(n)]
        await self.kube.create(
            core_path("namespaces"),
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        )
        await self.nodes(zone, names, index_offset)
        await _until(lambda: self._has_default_sa(ns), "default ServiceAccount", 60, 0.2)
        baseline = await self.baseline_create(ns, n)
        try:
            row = {
                "nodes": n,
                "baseline_create_s": baseline,
                **await self._measure(n, zone, ns, job, names, index_offset),
            }
        finally:
            with suppress(KubeError):
                await self.kube.delete(tj_path(ns, job))
            await asyncio.gather(
                *(self.kube.delete(core_path("nodes", name=x)) for x in [*names, f"{zone}-spare"]),
                return_exceptions=True,
            )
            with suppress(KubeError):
                await self.kube.delete(core_path("namespaces", name=ns))
        # The next size starts on a quiet cluster: deleting a thousand pods (the garbage
        # collector, KWOK, the scheduler's cache, every watcher) would otherwise be counted
        # in its start.
        await _until(lambda: self._gone(ns), f"namespace {ns} deleted", 600, 0.5)
        await _until(lambda: self._no_leases(zone), f"{zone}'s node Leases deleted", 600, 0.5)
        return row

    async def _no_leases(self, zone: str) -> bool:
        """No Lease of this size's nodes is left (the garbage collector deletes them after
        their Nodes)."""
        leases = await self.kube.list(NODE_LEASES)
        return not any(x["metadata"]["name"].startswith(f"{zone}-") for x in leases)

    async def _gone(self, ns: str) -> bool:
        try:
            await self.kube.get(core_path("namespaces", name=ns))
        except KubeError as exc:
            return exc.status == 404
        return False

    async def _has_default_sa(self, ns: str) -> bool:
        try:
            await self.kube.get(core_path("serviceaccounts", ns, "default"))
        except KubeError:
            return False
        return True

    async def _measure(
        self, n: int, zone: str, ns: str, job: str, names: list[str], offset: int
    ) -> dict[str, float]:
        manifest = {
            "apiVersion": "bulkhead.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": job, "namespace": ns},
            "spec": {
                "workers": n,
                "minWorkers": 1,
                "faultTolerance": {
                    "maxFailures": min(1, n - 1),
                    "hangTimeoutSeconds": 600,
                    "registrationTimeoutSeconds": 600,
                },
                "template": {
                    "spec": {
                        "nodeSelector": {"topology.kubernetes.io/zone": zone},
                        "containers": [{"name": "trainer", "image": "bulkhead:bench"}],
                    }
                },
            },
        }
        every = max(0.1, n / 2000)
        before_start = await self._counters()
        bench_cpu = time.process_time()
        started = time.perf_counter()
        await self.kube.create(tj_path(ns), manifest)
        secret = await _until(
            lambda: self._secret(ns, f"{job}-control"), "the job's Secret", 120, every
        )
        token = base64.b64decode(secret["data"]["token"]).decode()
        http = httpx.AsyncClient(
            base_url=f"{self.url}/v1/jobs/{ns}.{job}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
            limits=httpx.Limits(max_connections=REGISTER_CONCURRENCY),
        )
        workers = PlayedWorkers(http, n, started)
        feed = CollectionWatch(
            self.kube,
            core_path("pods", ns),
            workers.on_pod,
            label_selector=f"bulkhead.dev/job={job}",
        )
        feeding = asyncio.create_task(feed.run())
        try:
            async with asyncio.timeout(600):
                await workers.all_registered()
            tj = await _until(lambda: self._phase(ns, job, "Running"), "phase Running", 600, every)
            job_running = time.perf_counter() - started
            after_start = await self._counters()
            # This process plays the workers on the same cores as the control plane.
            bench_start_cpu_s = time.process_time() - bench_cpu
            pods = dict(workers.pods)
            generation = tj["status"]["membership"]["generation"]

            await self.nodes(zone, [f"{zone}-spare"], offset + n)
            victim = sorted(pods)[0]
            bad_node = pods[victim]["spec"]["nodeName"]
            survivor = sorted(pods)[-1]
            poll = asyncio.create_task(
                _retrying_transport(
                    lambda: http.get(
                        "/membership",
                        params={"after": generation, "timeout": 60, "worker": survivor},
                        headers={MEMBER_HEADER: workers.credentials[survivor]},  # a member's
                    )
                )
            )
            await asyncio.sleep(0.2)  # the long poll is parked at the endpoint
            before_anomaly = await self._counters()
            t0 = time.perf_counter()
            await self._set_anomaly(bad_node)
            taint_task = asyncio.create_task(self._tainted(bad_node, t0))
            replacement_task = asyncio.create_task(self._replacement(workers, t0))
            view = (await poll).json()
            to_generation = time.perf_counter() - t0
            if view["generation"] <= generation:
                raise RuntimeError(f"no new generation: {view}")
            row = {
                "to_taint_s": await taint_task,
                "to_generation_s": to_generation,
                "to_replacement_running_s": await replacement_task,
                "job_running_s": job_running,
                "pods_running_s": workers.all_running_s,
                "registered_s": workers.all_registered_s,
                "bench_start_cpu_s": bench_start_cpu_s,
            }
            after_recovery = await self._counters()
            # What the operator spent: CPU and API requests (by lane) from the job's
            # creation to phase Running, and from the anomaly to the replacement Running.
            for phase, (a, b) in {
                "start": (before_start, after_start),
                "recovery": (before_anomaly, after_recovery),
            }.items():
                for key in sorted(set(a) | set(b)):
                    row[f"operator_{phase}_{key}"] = b.get(key, 0.0) - a.get(key, 0.0)
            return row
        finally:
            feeding.cancel()
            with suppress(asyncio.CancelledError):
                await feeding
            await http.aclose()

    async def _secret(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.kube.get(core_path("secrets", ns, name))
        except KubeError:
            return None

    async def _phase(self, ns: str, job: str, phase: str) -> dict[str, Any] | None:
        tj = await self.kube.get(tj_path(ns, job))
        return tj if (tj.get("status") or {}).get("phase") == phase else None

    async def _set_anomaly(self, node: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {
            "type": "BulkheadAnomaly",
            "status": "True",
            "reason": "XidError",
            "message": "xid 79 (bench)",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        await self.kube.request(
            "PATCH",
            core_path("nodes", name=node) + "/status",
            {"status": {"conditions": [condition]}},
            content_type=STRATEGIC,
        )

    async def _tainted(self, node: str, t0: float) -> float:
        async def check() -> bool:
            body = await self.kube.get(core_path("nodes", name=node))
            taints = body["spec"].get("taints") or []
            return any(t["key"] == "bulkhead.dev/unhealthy" for t in taints)

        await _until(check, f"{node} tainted", 120, 0.02)
        return time.perf_counter() - t0

    async def _replacement(self, workers: PlayedWorkers, t0: float) -> float:
        async with asyncio.timeout(300):
            await workers.newcomer.wait()
        return time.perf_counter() - t0


async def _retrying_transport(call: Any, attempts: int = 3) -> httpx.Response:
    """``call()`` again when a kept-alive connection turns out closed by the endpoint (its
    idle deadline passed, or both processes starved on a loaded machine): what a worker's
    client does."""
    for attempt in range(attempts):
        try:
            return await call()
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_operator(kubeconfig: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(Path(sys.executable).with_name("bulkhead-operator")),
        f"--kubeconfig={kubeconfig}",
        "--listen-host=127.0.0.1",
        f"--port={port}",
        f"--control-url={url}",
        "--log-format=text",
        "--log-level=WARNING",
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"operator did not start:\n{log.read_text()[-3000:]}")


@contextmanager
def _busy_cores(count: int) -> Iterator[None]:
    """``count`` processes spinning on a core each (the "half the cores taken" case),
    in a process group of their own that is ended however the bench ends."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for hog in hogs:
            with suppress(ProcessLookupError):
                os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()


def _server_client(kubeconfig: Path) -> httpx.AsyncClient:
    """A plain client of the API server (for its /metrics, which is text, not JSON)."""
    creds = load_credentials(kubeconfig)
    tls: ssl.SSLContext | bool = False
    if creds.verify:
        tls = ssl.create_default_context(cafile=creds.ca_file)
        if creds.cert_file:
            tls.load_cert_chain(creds.cert_file, creds.key_file)
    auth = creds.authorization()
    headers = {"Authorization": auth} if auth else {}
    return httpx.AsyncClient(base_url=creds.server, verify=tls, headers=headers, timeout=30)


async def _run(
    kubeconfig: Path,
    sizes: list[int],
    log: Path,
    busy: int = 0,
    components: dict[str, int] | None = None,
) -> list[dict[str, float]]:
    kubectl = ["kubectl", f"--kubeconfig={kubeconfig}"]
    installed = subprocess.run(
        [*kubectl, "get", "crd", "trainingjobs.bulkhead.dev"], capture_output=True, check=False
    )
    if installed.returncode != 0:
        crd = ROOT / "crds" / "trainingjobs.bulkhead.dev.yaml"
        subprocess.run([*kubectl, "apply", "-f", str(crd)], check=True, capture_output=True)
    proc, url = _start_operator(kubeconfig, log)
    kube = KubeClient(load_credentials(kubeconfig), concurrency=64)
    server = _server_client(kubeconfig)
    try:
        rows = []
        offset = 1000
        for hogs in sorted({0, busy}):
            with _busy_cores(hogs):
                for n in sizes:
                    bench = Bench(kube, url, proc.pid, server, components)
                    row = await bench.size(n, offset)
                    rows.append({**row, "busy_cores": hogs})
                    offset += n + 1
        return rows
    finally:
        await kube.close()
        await server.aclose()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _print(rows: list[dict[str, float]]) -> None:
    head = (
        f"{'nodes':>6} {'busy':>4} {'to_taint_s':>11} {'to_gen_s':>9} {'to_repl_s':>10} "
        f"{'pods_running_s':>15} {'registered_s':>13} {'job_running_s':>14} "
        f"{'baseline_create_s':>18} {'ratio':>6}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['nodes']:>6} {r['busy_cores']:>4} {r['to_taint_s']:>11.3f} "
            f"{r['to_generation_s']:>9.3f} "
            f"{r['to_replacement_running_s']:>10.3f} {r['pods_running_s']:>15.2f} "
            f"{r['registered_s']:>13.2f} "
            f"{r['job_running_s']:>14.2f} "
            f"{r['baseline_create_s']:>18.2f} {r['ratio_baseline_to_job_running']:>6.2f}"
        )
    print(
        "ratio = baseline_create_s / job_running_s (>1: our whole start beats sequential "
        "creation alone). Targets at 1000 nodes: to_taint_s <= 1, to_gen_s <= 1, "
        "to_repl_s <= 5, job_running_s <= 30; with busy cores (half of them spinning), "
        "within 2x of those."
    )
    print(f"{'nodes':>6} {'busy':>4} {'phase':>9} {'op_cpu_s':>9}  requests by lane (wait s)")
    for r in rows:
        for phase in ("start", "recovery"):
            lanes = "  ".join(
                f"{lane} {r.get(f'operator_{phase}_requests_{lane}', 0):.0f}"
                f" ({r.get(f'operator_{phase}_wait_s_{lane}', 0):.2f})"
                for lane in ("urgent", "routine", "background", "watch")
            )
            cpu = r[f"operator_{phase}_cpu_s"]
            print(f"{r['nodes']:>6} {r['busy_cores']:>4} {phase:>9} {cpu:>9.2f}  {lanes}")
    print("The job's start: CPU seconds by process; the API server's writes per worker pod")
    for r in rows:
        cpu = {"operator": r["operator_start_cpu_s"], "bench": r["bench_start_cpu_s"]}
        prefix = "operator_start_cpu_s_"
        cpu |= {k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}
        print(
            f"{r['nodes']:>6} {r['busy_cores']:>4}  total {sum(cpu.values()):.1f}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
        )
        prefix = "operator_start_writes_"
        writes = {k.removeprefix(prefix): v / r["nodes"] for k, v in r.items()
                  if k.startswith(prefix) and v / r["nodes"] >= 0.01}  # fmt: skip
        print(
            f"{'':>12}writes/pod {sum(writes.values()):.2f}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(writes.items(), key=lambda kv: -kv[1]))
        )


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100,1000", help="comma-separated node counts")
    parser.add_argument("--quick", action="store_true", help="10 nodes only (smoke test)")
    parser.add_argument("--kubeconfig", type=Path, help="use this cluster instead of a new one")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="also run every size with N processes spinning on a core each",
    )
    args = parser.parse_args()
    sizes = [10] if args.quick else [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        cluster = None
        kubeconfig = args.kubeconfig
        if kubeconfig is None:
            from k8s_cluster import Cluster

            cluster = Cluster.start(Path(tmp) / "k8s", gpu_nodes=0)
            kubeconfig = cluster.kubeconfig
        try:
            # The control plane's processes (started here, or a `make cluster` one whose
            # state file sits next to its kubeconfig): their CPU is counted too.
            plane = ControlPlane.attach(kubeconfig.parent)
            components = {c.name: c.pid for c in plane.components} if plane else None
            rows = asyncio.run(
                _run(kubeconfig, sizes, Path(tmp) / "operator.log", args.busy, components)
            )
        finally:
            if cluster is not None:
                cluster.stop()
    for row in rows:
        row["ratio_baseline_to_job_running"] = row["baseline_create_s"] / row["job_running_s"]
    _print(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
