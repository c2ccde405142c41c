"""The control endpoint: the HTTP face of the job sessions.

``ControlApp`` (plain ASGI) checks the token, caps bodies, counts requests and answers the
membership long poll from the session's once-per-view encoding; the reports and
registration go on to FastAPI, which validates them.

Routes and models are the control protocol of ``bulkhead.api.protocol``. Every job route
needs ``Authorization: Bearer <job token>``, checked before a byte of the body is read;
an unknown job and a wrong token get the same answer (no probing of job names), and a
body over ``MAX_BODY_BYTES`` is refused (413) before it is parsed. Reports, and polls that
name a worker, also need that worker's member credential (``MEMBER_HEADER``, issued at
registration; ``session.credentials``): 401 without one, 403 with another member's.
Bad input gets a 4xx with a JSON body
``{"error": <one line>, "details": [<field: problem>, ...]}``; the server never answers a
worker's mistake with a 500. ``/healthz`` and ``/metrics`` (Prometheus) need no token.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import math
import resource
import socket
import time
from collections.abc import Coroutine, Generator
from typing import Annotated, Any, TypeVar
from urllib.parse import parse_qs

import uvicorn
import uvloop
from fastapi import Depends, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from bulkhead.api.protocol import (
    API_PREFIX,
    DELTA_BASE_HEADER,
    MEMBER_HEADER,
    CompletionReport,
    Directive,
    FaultReport,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
)
from bulkhead.operator import metrics
from bulkhead.operator.connections import GuardedHttpProtocol, connection_cap
from bulkhead.operator.session.credentials import Admission
from bulkhead.operator.session.job import JobSession, SessionError, SessionRegistry
from bulkhead.operator.view_encoding import ViewEncodings

log = logging.getLogger(__name__)

MAX_POLL_SECONDS = 300.0
# Protocol messages are a few KB (a membership answer of 16,384 workers is ~1.7 MB, but
# that travels the other way): anything larger is refused unread.
MAX_BODY_BYTES = 1 << 20
_REFUSED = "unknown job or wrong token"


def _error(status: int, message: str, details: list[str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "details": details or []}, status_code=status)


def _location(loc: tuple[object, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authorized(
    registry: SessionRegistry, job: str, authorization: str | None
) -> tuple[JobSession, Admission]:
    """The job's session if ``authorization`` carries its token, current or replaced by a
    rotation (``JobTokens``: which one is the second value); SessionError otherwise."""
    if authorization is None:
        raise SessionError(401, "missing Authorization header (Bearer <job token>)")
    token = _bearer(authorization)
    if token is None:
        raise SessionError(401, "Authorization must be 'Bearer <job token>'")
    session = registry.get(job)
    if session is None:
        # Compare all the same, so an unknown job and a wrong token cost and read the same.
        hmac.compare_digest(token.encode(), b"\0" * len(token))
        raise SessionError(401, _REFUSED)
    admission = session.tokens.admits(token)
    if admission is None:
        raise SessionError(401, _REFUSED)
    return session, admission


async def admitted(
    registry: SessionRegistry, job: str, authorization: str | None, route: str, query: bytes
) -> JobSession:
    """``authorized``, after re-reading a job's token that a request does not match (it may
    have been rotated); a replaced token admits only requests on ``route`` (with ``query``)
    that must carry a member's credential too (``_credentialed``)."""
    try:
        session, admission = authorized(registry, job, authorization)
    except SessionError as exc:
        known = registry.get(job)
        if exc.message != _REFUSED or known is None or not await known.tokens.refresh():
            raise
        session, admission = authorized(registry, job, authorization)
    if admission == "previous" and not _credentialed(route, query):
        raise SessionError(401, "this job token was replaced: register with the current one")
    return session


def _credentialed(route: str, query: bytes) -> bool:
    """Whether a request on ``route`` must carry a member's credential (reports, and polls
    naming a worker)."""
    if route in ("progress", "faults", "complete"):
        return True
    return route == "membership" and "worker" in parse_qs(query.decode("latin-1"))


MEMBERSHIP_ROUTE = API_PREFIX + "/{job}/membership"


def _membership_query(query: bytes) -> tuple[int, float, str | None]:
    """``after``, ``timeout`` and ``worker`` of a membership poll; SessionError(422) naming
    the field otherwise."""
    params = parse_qs(query.decode("latin-1"), keep_blank_values=True)

    def one(name: str) -> str | None:
        values = params.get(name)
        return values[-1] if values else None

    problems: list[str] = []
    after, timeout, worker = 0, 30.0, one("worker")
    try:
        after = int(one("after") or 0)
        if after < 0:
            problems.append("after: must be >= 0")
    except ValueError:
        problems.append("after: must be an integer")
    try:
        timeout = float(one("timeout") or 30.0)
        if not math.isfinite(timeout) or not 0 <= timeout <= MAX_POLL_SECONDS:
            problems.append(f"timeout: must be between 0 and {MAX_POLL_SECONDS:g}")
    except ValueError:
        problems.append("timeout: must be a number")
    if worker is not None and not 1 <= len(worker) <= 253:
        problems.append("worker: must be 1 to 253 characters")
    if problems:
        raise SessionError(422, "invalid request: " + "; ".join(problems))
    return after, timeout, worker


async def _send_bytes(
    send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve_membership(
    session: JobSession,
    encodings: ViewEncodings,
    scope: dict[str, Any],
    headers: dict[str, str],
    send: Any,
) -> None:
    """The membership long poll, answered from the view's shared encoding.

    Served here in plain ASGI rather than through FastAPI: when a generation is published
    every worker's poll answers at once, and the per-request work must be a few dict
    lookups and one write of bytes that already exist. A client that sends the view's
    ETag in ``If-None-Match`` (it is current and the poll timed out) gets 304 and no body.
    """
    try:
        after, timeout, worker = _membership_query(scope.get("query_string", b""))
        if worker is not None:  # a poll naming a worker keeps it alive: only its own may
            session.authenticate(worker, headers.get(MEMBER_HEADER.lower()), "membership poll")
        view = await session.wait_membership(after, timeout, worker)
    except SessionError as exc:
        await _error(exc.status_code, exc.message)(scope, _no_body, send)
        return
    encoded = encodings.encoded(session, view)
    common = [(b"etag", encoded.etag.encode()), (b"vary", b"accept-encoding, if-none-match")]
    held = headers.get("if-none-match")
    if held == encoded.etag:
        await _send_bytes(send, 304, common, b"")
        return
    gzipped = "gzip" in headers.get("accept-encoding", "")
    base = encodings.recent(session, held) if held and gzipped else None
    if base is not None:
        # The client holds a recent view: send what changed (a few hundred bytes for a
        # one-member change instead of the whole list), encoded once per base.
        body = encoded.delta_from(base)
        extra = [(b"content-encoding", b"gzip"), (DELTA_BASE_HEADER.encode(), held.encode())]
    elif gzipped:
        body, extra = encoded.gzipped, [(b"content-encoding", b"gzip")]
    else:
        body, extra = encoded.body, []
    await _send_bytes(
        send,
        200,
        [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *common,
            *extra,
        ],
        body,
    )


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


class ControlApp:
    """The endpoint's outermost ASGI app: guard, membership route, request metrics.

    The job token is checked and the body size capped before anything reads the body, so
    an unauthenticated client cannot make the server parse. The membership poll is
    answered here (``serve_membership``); the other routes go to FastAPI. Plain ASGI on
    purpose: a publish answers every worker's poll at once, and Starlette's
    ``BaseHTTPMiddleware`` alone cost more per request than the whole answer.
    """

    def __init__(self, api: FastAPI, registry: SessionRegistry, max_body_bytes: int) -> None:
        self.api = api
        self.registry = registry
        self.max_body = max_body_bytes
        self.encodings = ViewEncodings()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted)
        finally:
            route = scope.get("bulkhead.route") or getattr(scope.get("route"), "path", None)
            route = route or "unmatched"
            metrics.CONTROL_REQUESTS.labels(route=route, code=str(status)).inc()
            metrics.CONTROL_LATENCY.labels(route=route).observe(time.perf_counter() - started)

    async def _handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        prefix = API_PREFIX + "/"
        if not scope["path"].startswith(prefix):
            await self.api(scope, receive, send)
            return
        job, _, route = scope["path"][len(prefix) :].partition("/")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            session = await admitted(
                self.registry,
                job,
                headers.get("authorization"),
                route,
                scope.get("query_string", b""),
            )
            declared = int(headers.get("content-length") or 0)
        except SessionError as exc:
            await _error(exc.status_code, exc.message)(scope, receive, send)
            return
        except ValueError:
            await _error(400, "bad Content-Length")(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == f"{prefix}{job}/membership":
            scope["bulkhead.route"] = MEMBERSHIP_ROUTE
            await serve_membership(session, self.encodings, scope, headers, send)
            return
        if declared > self.max_body:
            await _error(413, f"body over {self.max_body} bytes")(scope, receive, send)
            return
        # Read the body here, at most the cap (a chunked body declares no length), and
        # hand it on whole: the application never sees more than the cap.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_body:
                await _error(413, f"body over {self.max_body} bytes")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # disconnect, for long polls

        await self.api(scope, replay, send)


async def _session_for(
    request: Request,
    job: Annotated[str, Path(min_length=1, max_length=253)],
    authorization: Annotated[str | None, Header()] = None,
) -> JobSession:
    """The job's session (the token was checked by ``ControlApp`` already)."""
    return authorized(request.app.state.registry, job, authorization)[0]


Session = Annotated[JobSession, Depends(_session_for)]
Credential = Annotated[str | None, Header(alias=MEMBER_HEADER)]


def create_control_app(
    registry: SessionRegistry, max_body_bytes: int = MAX_BODY_BYTES
) -> ControlApp:
    """The ASGI app serving every job in ``registry``."""
    app = FastAPI(title="bulkhead control", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = registry

    @app.exception_handler(SessionError)
    async def _session_error(_: Request, exc: SessionError) -> JSONResponse:
        return _error(exc.status_code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [f"{_location(tuple(e['loc']))}: {e['msg']}" for e in exc.errors()]
        return _error(422, "invalid request: " + "; ".join(details), details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.post(API_PREFIX + "/{job}/register", response_model=RegisterResponse)
    async def register(
        req: RegisterRequest, session: Session, credential: Credential = None
    ) -> RegisterResponse:
        return await session.register(req, credential)

    # GET {job}/membership is served by ControlApp (serve_membership), before FastAPI.

    @app.post(API_PREFIX + "/{job}/progress", response_model=Directive)
    async def progress(
        report: ProgressReport, session: Session, credential: Credential = None
    ) -> Directive:
        session.authenticate(report.worker, credential, "progress")
        return await session.progress(report)

    @app.post(API_PREFIX + "/{job}/faults", response_model=Directive)
    async def faults(
        report: FaultReport, session: Session, credential: Credential = None
    ) -> Directive:
        session.authenticate_fault(report, credential)
        return await session.fault(report)

    @app.post(API_PREFIX + "/{job}/complete", response_model=Directive)
    async def complete(
        report: CompletionReport, session: Session, credential: Credential = None
    ) -> Directive:
        session.authenticate(report.worker, credential, "completion")
        return await session.complete(report)

    @app.get("/healthz")
    async def healthz() -> dict[str, int]:
        return {"jobs": len(registry)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return ControlApp(app, registry, max_body_bytes)


# Young-generation size and older-generation ratios of the cyclic GC in a process that
# serves the control endpoint (CPython's defaults: 700, 10, 10).
GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc_for_connections() -> None:
    """Collect cycles less often in a process holding thousands of open long polls.

    Each connection keeps hundreds of live objects; with the default thresholds the
    older generations, which hold all of them, were traversed again and again while a
    publication answered 16,384 polls: 20-40 % of the endpoint's CPU per answer
    (bench/control_scale.py). Objects alive at the first start are frozen out of
    collections (after one collection, so no garbage is frozen); once per process.
    """
    if gc.get_threshold() == GC_THRESHOLDS:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


T = TypeVar("T")


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one; returns (before, after), logged.

    Every worker holds a connection to the control endpoint (a long poll), and the
    operator's own API calls and Lease renewals need sockets too: at the usual soft limit
    of 1,024 a job of about 1,000 pods made them fail with EMFILE (issue 36).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = soft
    if hard == resource.RLIM_INFINITY or soft < hard:
        raised = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open
            log.warning("open files: cannot raise the limit from %d to %d: %s", soft, raised, exc)
            raised = soft
    log.info("open files: limit %d (was %d, hard limit %s)", raised, soft, hard)
    return soft, raised


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a control-plane process's loop on uvloop (libuv) rather than asyncio's, with
    the open-file limit raised first (``raise_open_file_limit``).

    With thousands of open long polls the endpoint's cost is per answer, not per byte:
    the event loop and the HTTP parser (``ControlServer`` uses httptools, also C) were
    most of it on the pure-Python stack (bench/control_scale.py, docs/control-plane.md).
    """
    raise_open_file_limit()
    return uvloop.run(main)


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the embedding process decides on shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class ControlServer:
    """Serves an app on the running event loop (local mode, tests); port 0 = a free port."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout_s: float = 5.0,
        headers_deadline_s: float = 10.0,
        max_connections: int | None = None,
    ) -> None:
        """``headers_deadline_s`` and ``max_connections`` (default: from the open-file
        limit, ``connection_cap``) guard the endpoint against idle connections
        (``bulkhead.operator.connections``)."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(
            app,
            log_config=None,  # the embedding process configures logging (JSON in the operator)
            log_level="warning",
            access_log=False,
            lifespan="off",
            # httptools, a C parser: with uvloop, about half the h11 + asyncio cost per answer.
            http=GuardedHttpProtocol.configured(
                headers_deadline_s,
                max_connections if max_connections is not None else connection_cap(),
            ),
            timeout_graceful_shutdown=shutdown_timeout_s,
        )
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout_s: float = 30.0) -> str:
        tune_gc_for_connections()
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("control server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"control server not up within {timeout_s}s")
            await asyncio.sleep(0.01)
        log.info("control endpoint on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._sock.close()
