"""Benchmark of the control plane at the scale of the largest runs (issue 22).

The REAL control endpoint and job session (``create_control_app`` + ``JobSession`` behind
uvicorn, a driver that starts nothing) run in one process; simulated workers run as
asyncio tasks of aiohttp clients (a well-kept async HTTP client; it comes with the
operator's kopf) spread over several processes. Each simulated worker does what a trainer
does on the wire: register, long-poll membership (``after=G``, its ETag, gzip), and the
rank-0 worker posts progress at 1 step/s. Per size:

- ``register_all_s``: first registration sent -> last registration answered;
- ``first_generation_all_s``: last registration answered -> every worker holds generation 1;
- ``next_generation_all_s``: one member exits (the session is told, as a driver would) ->
  every survivor holds generation 2 (publish is immediate: the exit is one event);
- ``steady_requests_per_s``: control requests the endpoint answered per second, in steady
  state at 1 step/s, over a window longer than one poll period;
- ``cpu_cores``: the endpoint's CPU in that steady window (cores); ``rss_mb``: its peak RSS.

Simulated workers read every answer whole (the bytes a worker receives) but do not
decompress or parse it: a real worker does that on its own CPU, once per generation
(measured here once and printed: ``client_decode_ms``), while on this 2-core machine it
would be charged to the endpoint's timings.

This 2-core machine does simulate 16,384 workers (about 16,400 sockets each side, 360 MB
in the endpoint), but the simulated workers share its two cores with the endpoint, so
the measured times there overstate what the endpoint alone needs: beside each row the
bench prints the endpoint-bound estimate (workers x the endpoint's CPU per answer). Sizes
above ``--max-simulated`` are EXTRAPOLATED from the per-request costs measured at the
largest simulated size, with the model printed beside the figures. The JSON written by
``--out`` is a list of rows with exactly the keys above plus ``workers``.

    python bench/control_scale.py --quick --out control-scale.json     # 1,024 workers
    python bench/control_scale.py --out control-scale.json            # 1,024 / 4,096 / 16,384
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bulkhead.operator.local.children import end_children_on_exit

JOB = "scale"
TOKEN = "bench-token"
HANG_S = 120.0  # the default hangTimeoutSeconds: polls are capped at 30 s
POLL_S = 30.0  # what a trainer asks for (trainer.config.MEMBERSHIP_POLL_SECONDS)
GPUS_PER_NODE = 8
TARGETS = {  # at 16,384 workers (issue 22)
    "next_generation_all_s": 1.0,
    "first_generation_all_s": 5.0,
    "steady_requests_per_s": 1000.0,
    "cpu_cores": 1.0,
    "rss_mb": 1024.0,
}


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def worker_id(index: int) -> str:
    from bulkhead.operator.lifecycle.workers import worker_id as make

    return make(JOB, index, 0)


def _host(index: int) -> str:
    return f"10.{index // 65536}.{index // 256 % 256}.{index % 256}"


# ---------------------------------------------------------------- the endpoint process


def _endpoint_main(conn: Connection, workers: int, max_failures: int = 1) -> None:
    """The real endpoint and session; answers the controller's commands on ``conn``."""
    _raise_fd_limit()
    from bulkhead.operator.control import run_event_loop  # the operator's own loop

    profile = os.environ.get("BULKHEAD_BENCH_PROFILE")  # a path: cProfile the endpoint
    if not profile:
        run_event_loop(_endpoint(conn, workers, max_failures))
        return
    import cProfile

    cProfile.runctx(
        "run_event_loop(_endpoint(conn, workers, max_failures))", globals(), locals(), profile
    )


class _NullDriver:
    """Starts nothing: the simulated workers are already there."""

    async def start_worker(self, worker: Any) -> None: ...

    async def stop_worker(self, worker: Any, reason: str) -> None: ...

    async def evict_node(self, node: str, reason: str) -> None: ...

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None: ...

    async def publish_status(self, status: Any) -> None: ...


def _requests_answered() -> float:
    from bulkhead.operator import metrics

    total = 0.0
    for family in metrics.CONTROL_REQUESTS.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return total


async def _endpoint(conn: Connection, workers: int, max_failures: int) -> None:
    from bulkhead.api.spec import TrainingJobSpec
    from bulkhead.operator.control import ControlServer, create_control_app
    from bulkhead.operator.lifecycle.types import WorkerExited
    from bulkhead.operator.session.job import JobSession, SessionRegistry, open_new
    from bulkhead.operator.view_encoding import EncodedView

    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "minWorkers": 1,
            "trainer": {"steps": 1_000_000},
            "faultTolerance": {"maxFailures": max_failures, "hangTimeoutSeconds": HANG_S},
        }
    )
    session = JobSession(open_new(JOB, spec), TOKEN, lambda _: _NullDriver())
    registry = SessionRegistry()
    registry.add(session)
    server = ControlServer(create_control_app(registry), host="127.0.0.1", port=0)
    await session.start()
    url = await server.start()
    published: dict[int, float] = {}

    async def watch_publications() -> None:
        generation = 0
        while True:
            view = await session.wait_membership(generation, HANG_S)
            if view.generation > generation:
                generation = view.generation
                published[generation] = time.time()

    watcher = asyncio.create_task(watch_publications())
    loop = asyncio.get_running_loop()
    conn.send(url)
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        match command:
            case ("exit", worker):
                session.observe(WorkerExited(worker, exit_code=1))
                conn.send(time.time())
            case ("published", generation):
                conn.send(published.get(generation))
            case ("requests",):
                conn.send(_requests_answered())
            case ("view_sizes",):
                encoded = EncodedView(session.state.membership)
                conn.send((len(encoded.body), len(encoded.gzipped)))
            case ("stop",):
                break
    watcher.cancel()
    await session.stop()
    await server.stop()
    conn.send("stopped")


# ---------------------------------------------------------------- simulated workers


def _clients_main(conn: Connection, url: str, indices: list[int], reporter: int | None) -> None:
    _raise_fd_limit()
    asyncio.run(_clients(conn, url, indices, reporter))


async def _clients(conn: Connection, url: str, indices: list[int], reporter: int | None) -> None:
    import aiohttp

    from bulkhead.api.protocol import MEMBER_HEADER

    prefix = f"{url}/v1/jobs/{JOB}"
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept-Encoding": "gzip"}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    loop = asyncio.get_running_loop()
    seen: dict[int, dict[str, float]] = {}  # generation -> worker -> when it got it
    gone: set[str] = set()
    credentials: dict[str, dict[str, str]] = {}  # worker -> its member credential header
    requests = 0
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout, auto_decompress=False
    ) as http:

        async def register(index: int) -> float:
            nonlocal requests
            wid = worker_id(index)
            body = {
                "worker": wid,
                "node": f"node-{index // GPUS_PER_NODE}",
                "address": f"{_host(index)}:29500",
                "checkpointAddress": f"{_host(index)}:29700",
            }
            for attempt in range(20):
                try:
                    async with http.post(f"{prefix}/register", json=body) as reply:
                        answer = await reply.read()
                        requests += 1
                        if reply.status == 200:
                            credential = json.loads(answer)["credential"]
                            credentials[wid] = {MEMBER_HEADER: credential}
                            return time.time()
                        raise RuntimeError(f"register {wid}: HTTP {reply.status}")
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05 * (attempt + 1))
            raise RuntimeError(f"register {wid}: no connection")

        async def poll(index: int) -> None:
            nonlocal requests
            wid = worker_id(index)
            after, etag = 0, None
            while True:
                params = {"after": str(after), "timeout": str(POLL_S), "worker": wid}
                extra = {**credentials[wid], **({"If-None-Match": etag} if etag else {})}
                try:
                    async with http.get(
                        f"{prefix}/membership", params=params, headers=extra
                    ) as reply:
                        await reply.read()
                        requests += 1
                        if reply.status in (404, 409):
                            gone.add(wid)
                            return
                        if reply.status == 304:
                            continue
                        if reply.status != 200:
                            await asyncio.sleep(0.1)
                            continue
                        etag = reply.headers["ETag"]
                        generation = int(etag.strip('"').split("-")[0][1:])
                        if generation > after:
                            seen.setdefault(generation, {})[wid] = time.time()
                            after = generation
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)

        async def report_progress(index: int) -> None:
            nonlocal requests
            wid, step = worker_id(index), 0
            while True:
                await asyncio.sleep(1.0)  # 1 step/s
                generation = max(seen) if seen else 0
                if not generation:
                    continue
                body = {"worker": wid, "generation": generation, "step": step, "loss": 1.0}
                async with http.post(
                    f"{prefix}/progress", json=body, headers=credentials[wid]
                ) as reply:
                    await reply.read()
                    requests += 1
                step += 1

        tasks: list[asyncio.Task[None]] = []
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            match command:
                case ("register", start_at):
                    await asyncio.sleep(max(0.0, start_at - time.time()))
                    # At most 512 connections opening at once per process: a real fleet's
                    # workers start over seconds, not in one SYN burst.
                    gate = asyncio.Semaphore(512)
                    done = await asyncio.gather(*(_gated(gate, register(i)) for i in indices))
                    conn.send((start_at, max(done)))
                case ("poll",):
                    tasks = [asyncio.create_task(poll(i)) for i in indices]
                    if reporter is not None:
                        tasks.append(asyncio.create_task(report_progress(reporter)))
                    conn.send("polling")
                case ("seen", generation):
                    got = seen.get(generation, {})
                    conn.send((len(got), max(got.values()) if got else None, len(gone)))
                case ("requests",):
                    conn.send(requests)
                case ("stop",):
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    conn.send("stopped")
                    return


async def _gated(gate: asyncio.Semaphore, call: Any) -> Any:
    async with gate:
        return await call


# ---------------------------------------------------------------- the controller


@dataclass
class ProcStat:
    cpu_s: float
    rss_mb: float
    peak_rss_mb: float


def _proc_stat(pid: int) -> ProcStat:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = peak = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return ProcStat(cpu, rss, peak)


def _stop_child(conn: Connection, proc: Any) -> None:
    """Ask a child process to stop, if it is alive: one already ended (SIGTERM's
    end_children) never answers, and this process still holds its end of the pipe, so a
    plain recv would wait for ever (no EOF either)."""
    if not proc.is_alive():
        return
    with contextlib.suppress(EOFError, OSError):
        conn.send(("stop",))
        if conn.poll(10):
            conn.recv()


def _ask(conn: Connection, command: tuple[Any, ...]) -> Any:
    conn.send(command)
    return conn.recv()


def _wait_all_seen(
    clients: list[Connection], generation: int, expected: int, timeout_s: float
) -> float:
    """When the last worker got ``generation`` (wall clock); raises if not all did."""
    deadline = time.monotonic() + timeout_s
    while True:
        answers = [_ask(c, ("seen", generation)) for c in clients]
        count = sum(a[0] for a in answers)
        if count >= expected:
            return max(a[1] for a in answers if a[1] is not None)
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {count}/{expected} workers saw generation {generation}")
        time.sleep(0.05)


def measure(workers: int, processes: int, steady_s: float) -> dict[str, Any]:
    """One size, simulated for real; the row plus per-request costs for the model."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    endpoint = ctx.Process(target=_endpoint_main, args=(theirs, workers), daemon=True)
    endpoint.start()
    url = ours.recv()
    shares = [list(range(p, workers, processes)) for p in range(processes)]
    clients, procs = [], []
    for share in shares:
        mine, other = ctx.Pipe()
        reporter = 0 if 0 in share else None  # rank 0 reports progress
        proc = ctx.Process(target=_clients_main, args=(other, url, share, reporter), daemon=True)
        proc.start()
        clients.append(mine)
        procs.append(proc)
    try:
        assert endpoint.pid is not None
        pid = endpoint.pid
        before = _proc_stat(pid)
        start_at = time.time() + 0.5
        for c in clients:
            c.send(("register", start_at))
        registered = [c.recv() for c in clients]
        last_registered = max(r[1] for r in registered)
        after_register = _proc_stat(pid)
        for c in clients:
            assert _ask(c, ("poll",)) == "polling"
        gen1_all = _wait_all_seen(clients, 1, workers, 120)
        after_gen1 = _proc_stat(pid)
        body, gzipped = _ask(ours, ("view_sizes",))
        time.sleep(1.0)  # let the first re-polls settle
        victim = worker_id(workers - 1)
        mark = _proc_stat(pid)
        exited_at = _ask(ours, ("exit", victim))
        gen2_all = _wait_all_seen(clients, 2, workers - 1, 120)
        published2 = _ask(ours, ("published", 2))
        after_gen2 = _proc_stat(pid)
        # Steady state: polls already current come back 304 every ~22-30 s; rank 0 reports
        # each second. The window starts after the wave of generation 2's answers.
        time.sleep(2.0)
        req0, stat0, t0 = _ask(ours, ("requests",)), _proc_stat(pid), time.monotonic()
        time.sleep(steady_s)
        req1, stat1, t1 = _ask(ours, ("requests",)), _proc_stat(pid), time.monotonic()
        client_requests = sum(_ask(c, ("requests",)) for c in clients)
        return {
            "row": {
                "workers": workers,
                "register_all_s": round(last_registered - start_at, 3),
                "first_generation_all_s": round(gen1_all - last_registered, 3),
                "next_generation_all_s": round(gen2_all - exited_at, 3),
                "steady_requests_per_s": round((req1 - req0) / (t1 - t0), 1),
                "cpu_cores": round((stat1.cpu_s - stat0.cpu_s) / (t1 - t0), 3),
                "rss_mb": round(stat1.peak_rss_mb, 1),
            },
            "costs": {
                "register_cpu_ms": 1000 * (after_register.cpu_s - before.cpu_s) / workers,
                "full_answer_cpu_ms": 1000 * (after_gen1.cpu_s - after_register.cpu_s) / workers,
                "next_answer_cpu_ms": 1000 * (after_gen2.cpu_s - mark.cpu_s) / (workers - 1),
                "publish_after_exit_s": (published2 or exited_at) - exited_at,
                "rss_per_worker_kb": 1024 * (stat1.rss_mb - before.rss_mb) / workers,
                "base_rss_mb": before.rss_mb,
                "view_json_bytes": body,
                "view_gzip_bytes": gzipped,
                "client_requests": client_requests,
            },
        }
    finally:
        for conn, proc in zip([*clients, ours], [*procs, endpoint], strict=True):
            _stop_child(conn, proc)
        for proc in [*procs, endpoint]:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def client_decode_ms(gzip_bytes: bytes) -> float:
    """What one real worker spends once per generation: gunzip + parse + validate."""
    from bulkhead.api.protocol import MembershipView

    started = time.perf_counter()
    MembershipView.model_validate(json.loads(gzip.decompress(gzip_bytes)))
    return 1000 * (time.perf_counter() - started)


def _one_exit_delta_bytes(workers: int) -> int:
    """The gzipped delta a survivor gets when the last of ``workers`` exits."""
    from bulkhead.api.protocol import MembershipView, membership_delta

    base = MembershipView.model_validate(json.loads(gzip.decompress(_sample_view(workers))))
    survivors = base.members[:-1]
    nxt = base.model_copy(update={"generation": 2, "members": survivors})
    delta = json.dumps(membership_delta(base, nxt), separators=(",", ":")).encode()
    return len(gzip.compress(delta, compresslevel=1, mtime=0))


def _sample_view(workers: int) -> bytes:
    from bulkhead.api.protocol import MembershipView
    from bulkhead.api.status import Member

    members = [
        Member(
            rank=i,
            worker=worker_id(i),
            node=f"node-{i // GPUS_PER_NODE}",
            address=f"{_host(i)}:29500",
            checkpoint_address=f"{_host(i)}:29700",
        )
        for i in range(workers)
    ]
    view = MembershipView(
        generation=1, coordinator=members[0].address, members=members, state="running"
    )
    return gzip.compress(view.model_dump_json(by_alias=True).encode(), compresslevel=1)


def relay_fanout(processes: int, rounds: int) -> list[float]:
    """The pod relay's share of "every process sees the new generation", measured: the REAL
    relay of one pod (``trainer.pod.relay``) and its ``processes`` trainer processes (threads
    long-polling it with the trainer's own ``HttpControlClient``) against the real endpoint,
    with ``rounds`` other pods; each round one other pod exits, and the time from the
    session's publication to the last of the pod's processes holding the generation is
    one sample (seconds)."""
    import threading

    from bulkhead.api.client import HttpControlClient
    from bulkhead.api.protocol import RegisterRequest
    from bulkhead.trainer.pod.launcher import ServingRelay
    from bulkhead.trainer.pod.relay import PodRelay

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    # Every round loses one more pod (nothing replaces them): maxFailures allows them all.
    endpoint = ctx.Process(target=_endpoint_main, args=(theirs, rounds + 1, rounds), daemon=True)
    endpoint.start()
    url = ours.recv()
    pod = worker_id(0)
    relay = PodRelay(url, TOKEN, JOB, pod, processes, poll_s=POLL_S)
    serving = ServingRelay(relay)
    serving.start()
    seen: dict[int, list[float]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def process(rank: int) -> None:
        client = HttpControlClient(
            f"http://127.0.0.1:{serving.port}/local/{rank}", TOKEN, JOB, pod, retries=1
        )
        client.register(
            RegisterRequest(
                worker=pod,
                address=f"{_host(0)}:29500" if rank == 0 else "",
                checkpoint_address=f"{_host(0)}:{29700 + rank}",
            )
        )
        after = 0
        while not stop.is_set():
            with contextlib.suppress(Exception):
                view = client.membership(after=after, timeout_s=2.0)
                if view.generation > after:
                    with lock:
                        seen.setdefault(view.generation, []).append(time.time())
                    after = view.generation

    threads = [threading.Thread(target=process, args=(r,), daemon=True) for r in range(processes)]
    try:
        for thread in threads:
            thread.start()
        for index in range(1, rounds + 1):
            with HttpControlClient(url, TOKEN, JOB, worker_id(index)) as other:
                other.register(
                    RegisterRequest(
                        worker=worker_id(index),
                        address=f"{_host(index)}:29500",
                        checkpoint_address=f"{_host(index)}:29700",
                    )
                )
        samples = []
        for generation in range(1, rounds + 1):
            if generation > 1:
                _ask(ours, ("exit", worker_id(rounds + 2 - generation)))
            deadline = time.monotonic() + 30
            while len(seen.get(generation, [])) < processes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the pod's processes did not all see {generation}")
                time.sleep(0.002)
            published = _ask(ours, ("published", generation))
            samples.append(max(seen[generation]) - published)
        return samples
    finally:
        stop.set()
        serving.stop()
        _stop_child(ours, endpoint)
        endpoint.join(10)
        if endpoint.is_alive():
            endpoint.kill()


def extrapolate(workers: int, base: dict[str, Any]) -> dict[str, Any]:
    """A row for ``workers`` from the per-request costs measured at a smaller size.

    The endpoint is one Python process: each phase costs (requests x CPU per request) of
    one core, and the answers' bytes scale with members (the view's size grows linearly).
    """
    measured_n = base["row"]["workers"]
    c = base["costs"]
    scale = workers / measured_n
    # A full answer's CPU grows with its bytes (members) on top of the per-request part;
    # take the measured per-answer cost as all per-request (optimistic) and as all
    # per-byte (pessimistic): report the pessimistic one.
    full_ms = c["full_answer_cpu_ms"] * scale
    next_ms = c["next_answer_cpu_ms"] * scale
    steady = (workers / (0.875 * POLL_S)) + 1.0  # mean capped poll 26.25 s, rank 0 at 1/s
    steady_cpu = base["row"]["cpu_cores"] * steady / max(base["row"]["steady_requests_per_s"], 1)
    return {
        "workers": workers,
        "register_all_s": round(workers * c["register_cpu_ms"] / 1000, 3),
        "first_generation_all_s": round(workers * full_ms / 1000, 3),
        "next_generation_all_s": round(
            c["publish_after_exit_s"] + (workers - 1) * next_ms / 1000, 3
        ),
        "steady_requests_per_s": round(steady, 1),
        "cpu_cores": round(steady_cpu, 3),
        "rss_mb": round(c["base_rss_mb"] + workers * c["rss_per_worker_kb"] / 1024, 1),
    }


EXTRAPOLATION_MODEL = (
    "extrapolated from the largest simulated size S: register_all = N x (endpoint CPU per "
    "registration at S); first/next generation = N x (CPU per membership answer at S) x N/S "
    "(an answer's bytes grow with members; pessimistic) [+ publish delay]; steady = N / "
    "26.25 s mean capped poll + 1 progress/s; cpu_cores = steady x (CPU per steady request "
    "at S); rss = base + N x (RSS per worker at S)"
)


def main(argv: list[str] | None = None) -> int:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,024 workers only")
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--max-simulated", type=int, default=16384)
    parser.add_argument("--processes", type=int, default=3, help="client processes")
    parser.add_argument("--steady-s", type=float, default=None, help="steady window (s)")
    parser.add_argument(
        "--processes-per-worker",
        type=int,
        default=GPUS_PER_NODE,
        help="trainer processes per worker pod, behind one pod relay (1: every process polls "
        "the endpoint itself)",
    )
    parser.add_argument("--relay-rounds", type=int, default=20, help="relay fan-out samples")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    _raise_fd_limit()
    sizes = [1024] if args.quick else [int(s) for s in args.sizes.split(",")]
    g = args.processes_per_worker
    if g < 1 or any(n % g for n in sizes):
        parser.error(f"every size must be a multiple of --processes-per-worker {g}")
    # The window spans at least one capped poll period, so every poller re-polls in it.
    steady_s = args.steady_s or POLL_S + 5
    fanout_s = 0.0
    if g > 1:
        samples = sorted(relay_fanout(g, args.relay_rounds))
        fanout_s = samples[-1]
        print(f"pod relay, {g} processes: publication -> last process holds it: median "
              f"{1000 * samples[len(samples) // 2]:.1f} ms, max {1000 * fanout_s:.1f} ms over "
              f"{len(samples)} generations (added to every generation time below)")  # fmt: skip
    rows, measured = [], None
    for n in sizes:
        pods = n // g
        label = f"{n} trainer processes ({pods} pods of {g})" if g > 1 else f"{n} workers"
        if pods <= args.max_simulated:
            measured = measure(pods, args.processes, steady_s)
            row, how = dict(measured["row"]), "measured"
            costs = measured["costs"]
            print(f"{label}: per-request costs {json.dumps(_rounded(costs))}")
            print(
                f"{label}: endpoint-bound (pollers x endpoint CPU per request, clients on "
                f"their own machines): register_all {pods * costs['register_cpu_ms'] / 1000:.2f}"
                f" s, first_generation_all {pods * costs['full_answer_cpu_ms'] / 1000:.2f} s, "
                f"next_generation_all {(pods - 1) * costs['next_answer_cpu_ms'] / 1000:.2f} s"
            )
        elif measured is not None:
            row, how = extrapolate(pods, measured), "EXTRAPOLATED"
            print(f"{label}: {EXTRAPOLATION_MODEL}")
        else:
            print(f"{label}: skipped (nothing simulated to extrapolate from)")
            continue
        # The endpoint serves the pods; each pod's relay hands the view to its processes.
        row["workers"], row["pods"] = n, pods
        for key in ("first_generation_all_s", "next_generation_all_s"):
            row[key] = round(row[key] + fanout_s, 3)
        rows.append(row)
        print(f"{label} ({how}): {json.dumps(row)}")
    if rows:
        _report(rows, measured)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def _report(rows: list[dict[str, Any]], measured: dict[str, Any] | None) -> None:
    """Ours vs the previous protocol (every poll re-encoded the whole view as JSON, every
    rank reported every step, polls were 10 s), side by side, and vs the targets."""
    largest = rows[-1]
    n, processes = largest["pods"], largest["workers"]
    sample = _sample_view(n)
    json_bytes = len(gzip.decompress(sample))
    print(f"\nat {n} pollers: one view is {json_bytes / 1e6:.2f} MB JSON, "
          f"{len(sample) / 1e6:.2f} MB gzip; a worker decodes it in "
          f"{client_decode_ms(sample):.0f} ms (once per generation, on its own CPU)")  # fmt: skip
    before_bytes = n * json_bytes
    after_bytes = n * len(sample)
    delta = _one_exit_delta_bytes(n)
    print(f"bytes to tell everyone the first generation: before {before_bytes / 1e9:.2f} GB, "
          f"now {after_bytes / 1e9:.2f} GB gzip ({before_bytes / max(after_bytes, 1):.1f}x "
          f"less); the next one after an exit: before {before_bytes / 1e9:.2f} GB, now "
          f"{n * delta / 1e6:.2f} MB ({delta} B deltas); an idle poll: before "
          f"{json_bytes / 1e6:.2f} MB, now a 304 (no body)")  # fmt: skip
    before_rps = processes * 1.0 + processes / 10.0  # every process polled and reported
    print(f"steady model at {n}: {n} polls / 26.25 s mean capped poll + 1 progress/s = "
          f"{n / (0.875 * POLL_S) + 1:,.0f} requests/s (a window right after a publish sees "
          "each poller re-poll about once, so the measured figure is a little lower)")  # fmt: skip
    print(f"steady requests/s at 1 step/s: before {before_rps:,.0f} (every rank every step + "
          f"10 s polls), now {largest['steady_requests_per_s']:,.0f} "
          f"({before_rps / max(largest['steady_requests_per_s'], 1):.0f}x less)")  # fmt: skip
    if processes == 16384:
        print(f"targets at 16,384 trainer processes ({n} pollers) (value vs target):")
        for key, target in TARGETS.items():
            verdict = "ok" if largest[key] <= target else "MISSED"
            print(f"  {key}: {largest[key]} vs <= {target} {verdict}")


if __name__ == "__main__":
    sys.exit(main())
