"""The control endpoint: the HTTP face of the job sessions (FastAPI).

Routes and models are the control protocol of ``bulkhead.api.protocol``. Every job route
needs ``Authorization: Bearer <job token>``. Bad input gets a 4xx with a JSON body
``{"error": <one line>, "details": [<field: problem>, ...]}``; the server never answers a
worker's mistake with a 500. ``/healthz`` and ``/metrics`` (Prometheus) need no token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from bulkhead.api.protocol import (
    API_PREFIX,
    CompletionReport,
    Directive,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
)
from bulkhead.operator import metrics
from bulkhead.operator.session.job import JobSession, SessionError, SessionRegistry

log = logging.getLogger(__name__)

MAX_POLL_SECONDS = 300.0


def _error(status: int, message: str, details: list[str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "details": details or []}, status_code=status)


def _location(loc: tuple[object, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


async def _session_for(
    request: Request,
    job: Annotated[str, Path(min_length=1, max_length=253)],
    authorization: Annotated[str | None, Header()] = None,
) -> JobSession:
    """The job's session, once the bearer token is checked."""
    registry: SessionRegistry = request.app.state.registry
    session = registry.get(job)
    if session is None:
        raise SessionError(404, f"no job named {job!r} is managed here")
    if authorization is None:
        raise SessionError(401, "missing Authorization header (Bearer <job token>)")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise SessionError(401, "Authorization must be 'Bearer <job token>'")
    if not hmac.compare_digest(token.strip().encode(), session.token.encode()):
        raise SessionError(403, f"wrong token for job {job!r}")
    return session


Session = Annotated[JobSession, Depends(_session_for)]


def create_control_app(registry: SessionRegistry) -> FastAPI:
    """The FastAPI app serving every job in ``registry``."""
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

    @app.middleware("http")
    async def _count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        metrics.CONTROL_REQUESTS.labels(route=route, code=str(response.status_code)).inc()
        metrics.CONTROL_LATENCY.labels(route=route).observe(time.perf_counter() - started)
        return response

    @app.post(API_PREFIX + "/{job}/register", response_model=RegisterResponse)
    async def register(req: RegisterRequest, session: Session) -> RegisterResponse:
        return await session.register(req)

    @app.get(API_PREFIX + "/{job}/membership", response_model=MembershipView)
    async def membership(
        session: Session,
        after: Annotated[int, Query(ge=0, description="Answer once generation > after.")] = 0,
        timeout: Annotated[float, Query(ge=0, le=MAX_POLL_SECONDS)] = 30.0,
        worker: Annotated[str | None, Query(min_length=1, max_length=253)] = None,
    ) -> MembershipView:
        return await session.wait_membership(after, timeout, worker)

    @app.post(API_PREFIX + "/{job}/progress", response_model=Directive)
    async def progress(report: ProgressReport, session: Session) -> Directive:
        return await session.progress(report)

    @app.post(API_PREFIX + "/{job}/faults", response_model=Directive)
    async def faults(report: FaultReport, session: Session) -> Directive:
        return await session.fault(report)

    @app.post(API_PREFIX + "/{job}/complete", response_model=Directive)
    async def complete(report: CompletionReport, session: Session) -> Directive:
        return await session.complete(report)

    @app.get("/healthz")
    async def healthz() -> dict[str, int]:
        return {"jobs": len(registry)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return app


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the embedding process decides on shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class ControlServer:
    """Serves an app on the running event loop (local mode, tests); port 0 = a free port."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 5.0
    ) -> None:
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
            timeout_graceful_shutdown=shutdown_timeout_s,
        )
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout_s: float = 30.0) -> str:
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
