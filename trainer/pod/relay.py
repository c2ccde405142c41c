"""The pod relay: one member's control traffic, on behalf of the pod's G trainer processes.

Each trainer process of a multi-process worker pod speaks the control protocol to this
relay (``http://127.0.0.1:<port>/local/<i>``, ``i`` its local rank) instead of to the
manager, so the manager sees one member per pod, as torchelastic's per-node agent does:

- *register*: each process checks in and is answered at once; when all G have, the relay
  registers the pod once, with local rank 0's store address (the pod's rendezvous address)
  and every process's sidecar address, comma-separated in local-rank order;
- *membership*: one long poll upstream, naming the pod once it is registered, answers the
  polls of all G processes (the manager keeps one poller per pod, not per GPU);
- *progress, faults, complete*: forwarded, answers and errors included; a fault or a
  completion all G report goes on once, and the pod's persisted step is its oldest.

The relay holds the pod's member credential (the answer to its one registration) and
sends it upstream with every poll and report; the processes never see it.

It also keeps each process's liveness (an open poll, or a request within a limit), which
the launcher reads to fail the pod when one process falls silent (stopped, or wedged).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote

import httpx
from pydantic import ValidationError

from bulkhead.api.client import (
    ControlError,
    ControlRequestError,
    HttpControlClient,
    MemberCredential,
)
from bulkhead.api.protocol import (
    API_PREFIX,
    FaultKind,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
)
from bulkhead.trainer.runtime.control_client import is_gone

log = logging.getLogger(__name__)

# A child's long poll waits at most this long here (the manager caps its own polls too).
MAX_POLL_S = 300.0
# After an upstream failure, the relay's poller waits this long before it asks again.
RETRY_S = 0.5
# Faults and completions sent once for the pod: the answers of this many are kept.
MAX_REMEMBERED_REPORTS = 256


@dataclass(frozen=True)
class CachedView:
    """The newest membership view, encoded once for every child's poll."""

    view: MembershipView
    body: bytes
    etag: str
    includes_pod: bool = False  # the pod is one of its members
    since: float = 0.0  # when the relay got it (monotonic)


@dataclass
class RegistrationOutcome:
    """How the pod's one upstream registration ended."""

    ok: bool
    status: int = 0  # the manager's HTTP status when it refused (0: unreachable)
    message: str = ""


class PodRelay:
    """The relay's state; served by ``relay_app`` on an event loop of its own thread."""

    def __init__(
        self,
        upstream_url: str,
        token: str,
        job: str,
        worker: str,
        processes: int,
        poll_s: float,
        timeout_s: float = 10.0,
    ) -> None:
        self.job = job
        self.worker = worker
        self.processes = processes
        self.poll_s = poll_s
        self._token = token
        self.member = MemberCredential()  # the pod's, once registered
        self._upstream_url = upstream_url.rstrip("/")
        self._timeout_s = timeout_s  # of each request to the manager, as a trainer's
        self._prefix = f"{API_PREFIX}/{quote(job, safe='')}"
        self._checked_in: dict[int, RegisterRequest] = {}
        self._lock = threading.Lock()
        self.registration: RegistrationOutcome | None = None
        self.registered = threading.Event()
        self._view: CachedView | None = None
        self._gone: tuple[int, bytes] | None = None  # the manager dropped the pod
        self._changed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._closing = threading.Event()
        self._poller: threading.Thread | None = None
        self._poll_client: HttpControlClient | None = None
        # Liveness of each local rank: open polls and the last request's start or end.
        self._open_polls = [0] * processes
        # Bumped by ``renew``: a request of a replaced process that ends later (its long
        # poll, answered to a dead client) must not count as its successor's life.
        self._epoch = 0
        self._last_seen: list[float | None] = [None] * processes
        # Reports the pod sends once, by (route, generation, kind, step): their answers.
        self._once: dict[tuple[Any, ...], asyncio.Future[tuple[int, bytes]]] = {}
        self._persisted: dict[int, int] = {}  # local rank -> its newest persisted step
        # Generations up to this one are not shown to the processes: they were those of the
        # processes a restart in place replaced (``renew``), which the new ones never join.
        self._floor = 0
        # Whether a process reported a step in a generation past the floor: the pod trains.
        self.trained = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """On the serving loop: the upstream client and the membership poller."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()
        self._http = httpx.AsyncClient(
            base_url=self._upstream_url,
            headers={"Authorization": f"Bearer {self._token}"},
            timeout=self._timeout_s,
        )
        self._poll_client = self._connect(None)  # names the pod once it is registered
        self._poller = threading.Thread(target=self._poll_upstream, name="relay-poll", daemon=True)
        self._poller.start()

    def close(self) -> None:
        """From any thread, as the pod ends: answer every open poll now (503) instead of at
        its timeout, which would hold up the server's shutdown and so the pod's end."""
        self._closing.set()
        self._call_soon(self._wake_polls)

    async def _wake_polls(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def stop(self) -> None:
        self._closing.set()
        if self._poll_client is not None:
            self._poll_client.close()  # ends a poll in flight: the poller sees it is closing
        if self._http is not None:
            await self._http.aclose()

    def _connect(self, worker: str | None) -> HttpControlClient:
        return HttpControlClient(
            self._upstream_url,
            self._token,
            self.job,
            worker,
            timeout_s=self._timeout_s,
            member=self.member,
        )

    # ------------------------------------------------------------ liveness

    def silent(self, limit_s: float, now: float | None = None) -> list[tuple[int, float]]:
        """Local ranks heard from before, with no open poll and no request for ``limit_s``
        (and for how long)."""
        now = time.monotonic() if now is None else now
        out = []
        for rank in range(self.processes):
            seen = self._last_seen[rank]
            if seen is not None and self._open_polls[rank] == 0 and now - seen >= limit_s:
                out.append((rank, now - seen))
        return out

    def renew(self) -> None:
        """The launcher replaced every process of the pod (pre-started ones took over): they
        check in again, the pod registers again once all have, and they see only
        generations newer than the current one (the manager drops the pod from the next)."""
        with self._lock:
            self._floor = self._view.view.generation if self._view is not None else 0
            self._epoch += 1
            self._open_polls = [0] * self.processes
            self._checked_in.clear()
            self.registration = None
            self.registered.clear()
            self._last_seen = [None] * self.processes
            self._persisted = {}
            self.trained = False

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (it exited)."""
        self._last_seen[rank] = None

    def _seen(self, rank: int, epoch: int | None = None) -> None:
        """Local rank ``rank`` was heard from (by a request of ``epoch``'s processes)."""
        if epoch is None or epoch == self._epoch:
            self._last_seen[rank] = time.monotonic()

    # ------------------------------------------------------------ register

    def check_in(self, rank: int, request: RegisterRequest) -> RegisterResponse:
        """Local rank ``rank`` is ready; the last one in registers the pod (in a thread)."""
        if request.worker != self.worker:
            raise ValueError(f"worker {request.worker!r} is not this pod's ({self.worker!r})")
        self._seen(rank)
        with self._lock:
            self._checked_in[rank] = request
            complete = len(self._checked_in) == self.processes and self.registration is None
            if complete:
                self.registration = RegistrationOutcome(ok=False, message="in progress")
        if complete:
            threading.Thread(target=self._register, name="relay-register", daemon=True).start()
        current = self._view.view.generation if self._view is not None else 0
        return RegisterResponse(worker=self.worker, generation=current)

    def pod_registration(self) -> RegisterRequest:
        """The pod's one registration, from what its processes checked in with."""
        first = self._checked_in[0]
        addresses = [self._checked_in[i].checkpoint_address for i in range(self.processes)]
        return RegisterRequest(
            worker=self.worker,
            node=first.node,
            address=first.address,
            checkpoint_address=",".join(addresses) if any(addresses) else "",
            incarnation=first.incarnation,
        )

    def _register(self) -> None:
        request = self.pod_registration()
        client = self._connect(self.worker)
        try:
            client.register(request)
        except ControlRequestError as exc:
            outcome = RegistrationOutcome(False, exc.status_code, exc.message)
        except ControlError as exc:
            outcome = RegistrationOutcome(False, 0, str(exc))
        else:
            outcome = RegistrationOutcome(True)
            if self._poll_client is not None:
                self._poll_client.worker = self.worker  # the pod's poll now keeps it alive
            log.info(
                "registered %s (%d processes, store at %s)",
                self.worker,
                self.processes,
                request.address,
            )
        finally:
            client.close()
        self.registration = outcome
        self.registered.set()

    def report_pod_failure(
        self, message: str, kind: FaultKind = "internal_error", timeout_s: float = 2.0
    ) -> None:
        """Best effort: why the pod failed (``internal_error``: it exits next; the manager
        replaces it) or restarted its processes in place (``processes_restarted``)."""
        view = self.view
        client = HttpControlClient(
            self._upstream_url,
            self._token,
            self.job,
            self.worker,
            timeout_s=timeout_s,
            retries=0,
            member=self.member,
        )
        try:
            client.fault(
                FaultReport(
                    worker=self.worker,
                    generation=view.generation if view is not None else 0,
                    kind=kind,
                    message=message[:4096],
                )
            )
        except ControlError as exc:
            log.warning("could not report the pod's failure: %s", exc)
        finally:
            client.close()

    # ------------------------------------------------------------ membership

    def _poll_upstream(self) -> None:
        """One long poll for the pod; each answer wakes every child's poll."""
        assert self._poll_client is not None
        after, timeout = 0, 0.0  # the first answer at once: children may poll right away
        while not self._closing.is_set():
            try:
                view = self._poll_client.membership(after=after, timeout_s=timeout)
            except ControlRequestError as exc:
                if is_gone(exc):  # dropped: tell the children, stop polling
                    body = json.dumps({"error": exc.message, "details": []}).encode()
                    self._call_soon(self._set_gone, exc.status_code, body)
                    return
                log.warning("membership poll refused: %s", exc)
                self._closing.wait(RETRY_S)
                continue
            except (ControlError, RuntimeError) as exc:  # RuntimeError: closed under it
                if self._closing.is_set():
                    return
                log.warning("membership poll failed: %s", exc)
                self._closing.wait(RETRY_S)
                continue
            after, timeout = view.generation, self.poll_s
            body = view.model_dump_json(by_alias=True).encode()
            cached = CachedView(
                view,
                body,
                f'"g{view.generation}-{view.state}"',
                includes_pod=any(m.worker == self.worker for m in view.members),
                since=time.monotonic(),
            )
            self._call_soon(self._set_view, cached)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(fn(*args)))

    async def _set_view(self, cached: CachedView) -> None:
        assert self._changed is not None
        if self._view is not None and self._view.etag == cached.etag:
            return
        async with self._changed:
            self._view = cached
            self._changed.notify_all()

    async def _set_gone(self, status: int, body: bytes) -> None:
        assert self._changed is not None
        async with self._changed:
            self._gone = (status, body)
            self._changed.notify_all()

    def trains(self, settle_s: float, now: float | None = None) -> bool:
        """Whether the pod trains: one of its processes reported a step, or it has been a
        member of the same running generation (one its processes see) for ``settle_s``
        (only the pod of rank 0 reports steps)."""
        if self.trained:
            return True
        cached = self._view
        if cached is None or not cached.includes_pod or cached.view.state != "running":
            return False
        now = time.monotonic() if now is None else now
        return self._shown(cached.view) and now - cached.since >= settle_s

    def restart_requested(self) -> MembershipView | None:
        """The manager's instruction to restart this pod's processes in place (a restart of
        the whole job: a hang, a NaN), once: a ``restarting`` generation naming the pod,
        newer than the processes it would replace. None otherwise."""
        cached = self._view
        if cached is None or cached.view.state != "restarting" or not cached.includes_pod:
            return None
        return cached.view if cached.view.generation > self._floor else None

    def _shown(self, view: MembershipView) -> bool:
        return view.generation > self._floor or view.state in ("succeeded", "failed")

    @property
    def view(self) -> MembershipView | None:
        return self._view.view if self._view is not None else None

    async def membership(
        self, rank: int, after: int, timeout_s: float, etag: str | None
    ) -> tuple[int, bytes, dict[str, str]]:
        """A child's long poll: the newest view once its generation is past ``after`` (or
        differs from the one the child holds), else at the timeout (304 if unchanged)."""
        assert self._changed is not None
        epoch = self._epoch
        self._open_polls[rank] += 1
        self._seen(rank)
        try:
            deadline = time.monotonic() + min(timeout_s, MAX_POLL_S)
            async with self._changed:
                while True:
                    if self._gone is not None:
                        return self._gone[0], self._gone[1], {}
                    if self._closing.is_set():
                        return 503, b'{"error": "the pod is stopping", "details": []}', {}
                    cached = self._view
                    if cached is not None and not self._shown(cached.view):
                        cached = None  # of the processes a restart replaced
                    if cached is not None and (
                        cached.view.generation > after or (etag is not None and etag != cached.etag)
                    ):
                        return 200, cached.body, {"etag": cached.etag}
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), left)
            if cached is None:
                return 503, b'{"error": "no membership from the manager yet", "details": []}', {}
            if etag == cached.etag:
                return 304, b"", {"etag": cached.etag}
            return 200, cached.body, {"etag": cached.etag}
        finally:
            with self._lock:  # against a renew in between
                if epoch == self._epoch:
                    self._open_polls[rank] -= 1
                    self._seen(rank)

    # ------------------------------------------------------------ reports

    async def report(self, rank: int, route: str, body: bytes) -> tuple[int, bytes]:
        """A report of local rank ``rank``, as the pod's: the G processes of a pod report
        the same fault or completion once (the first report goes on; the others get its
        answer), and the pod's persisted step is the oldest its processes report."""
        if route in ("faults", "complete"):
            try:
                data = json.loads(body)
                key = (route, data.get("generation"), data.get("kind"), data.get("step"))
            except (ValueError, AttributeError):
                return await self.forward(rank, route, body)  # the manager will say what
            pending = self._once.get(key)
            if pending is None:
                pending = self._once[key] = asyncio.ensure_future(self.forward(rank, route, body))
                while len(self._once) > MAX_REMEMBERED_REPORTS:  # the oldest first
                    self._once.pop(next(iter(self._once)))
            self._seen(rank)
            status, answer = await asyncio.shield(pending)
            if status >= 500:  # not answered: the next report of it is sent again
                self._once.pop(key, None)
            return status, answer
        if route == "progress":
            body = self._oldest_persisted(rank, body)
        return await self.forward(rank, route, body)

    def _oldest_persisted(self, rank: int, body: bytes) -> bytes:
        """A progress report as the pod's (its oldest persisted step); notes that the pod
        trains."""
        try:
            report = ProgressReport.model_validate_json(body)
        except ValidationError:
            return body  # the manager will say what is wrong with it
        if report.generation > self._floor and report.setup is None:
            self.trained = True
        if report.persisted_step is None:
            return body
        self._persisted[rank] = report.persisted_step
        oldest = min(self._persisted.values())
        if oldest == report.persisted_step:
            return body
        return (
            report.model_copy(update={"persisted_step": oldest})
            .model_dump_json(by_alias=True)
            .encode()
        )

    async def forward(self, rank: int, route: str, body: bytes) -> tuple[int, bytes]:
        """A report, passed on to the manager; its answer (or 502) comes back as it is."""
        assert self._http is not None
        epoch = self._epoch
        self._seen(rank)
        try:
            response = await self._http.post(
                f"{self._prefix}/{route}",
                content=body,
                headers={"Content-Type": "application/json", **self.member.headers()},
            )
        except httpx.TransportError as exc:
            message = f"the manager is unreachable from the pod relay: {exc}"
            return 502, json.dumps({"error": message, "details": []}).encode()
        finally:
            self._seen(rank, epoch)
        return response.status_code, response.content

    def authorized(self, authorization: str | None) -> bool:
        expected = f"Bearer {self._token}".encode()
        return hmac.compare_digest((authorization or "").encode(), expected)


_ROUTES = ("register", "membership", "progress", "faults", "complete")


def _json(status: int, body: bytes, extra: dict[str, str] | None = None) -> tuple[int, bytes, list]:
    headers = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    return status, body, headers


def _error(status: int, message: str) -> tuple[int, bytes, list]:
    return _json(status, json.dumps({"error": message, "details": []}).encode())


def relay_app(relay: PodRelay) -> Callable[..., Any]:
    """The relay's ASGI app: ``/local/<i>`` + the control protocol's job routes."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        status, body, headers = await _handle(relay, scope, receive)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _handle(relay: PodRelay, scope: dict[str, Any], receive: Any) -> tuple[int, bytes, list]:
    parts = scope["path"].strip("/").split("/")
    # local/<i>/v1/jobs/<job>/<route>
    if len(parts) != 6 or parts[0] != "local" or "/" + "/".join(parts[2:4]) != API_PREFIX:
        return _error(404, f"no such route: {scope['path']}")
    try:
        rank = int(parts[1])
    except ValueError:
        return _error(404, f"no such local rank: {parts[1]}")
    job, route = parts[4], parts[5]
    if not 0 <= rank < relay.processes or job != relay.job or route not in _ROUTES:
        return _error(404, f"no such route: {scope['path']}")
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if not relay.authorized(headers.get("authorization")):
        return _error(401, "unknown job or wrong token")
    body = await _read_body(receive)
    if route == "membership" and scope["method"] == "GET":
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            after = int(params.get("after", ["0"])[-1])
            timeout = float(params.get("timeout", ["30"])[-1])
            if after < 0 or not math.isfinite(timeout) or timeout < 0:
                raise ValueError("out of range")
        except ValueError as exc:
            return _error(422, f"invalid request: after/timeout: {exc}")
        status, payload, extra = await relay.membership(
            rank, after, timeout, headers.get("if-none-match")
        )
        return _json(status, payload, extra)
    if scope["method"] != "POST":
        return _error(405, f"{route} takes POST")
    if route == "register":
        try:
            answer = relay.check_in(rank, RegisterRequest.model_validate_json(body))
        except (ValidationError, ValueError) as exc:
            return _error(422, f"invalid registration: {exc}")
        return _json(200, answer.model_dump_json(by_alias=True).encode())
    status, payload = await relay.report(rank, route, body)
    return _json(status, payload)
