"""The worker-side client of the control protocol (httpx, synchronous).

Lives in ``bulkhead.api`` because the trainer may not import the operator. Every call has
a timeout; connection failures, 5xx and 429 answers are retried with exponential backoff;
a 4xx answer raises ``ControlRequestError`` with the server's one-line explanation, since
retrying a bad request cannot help. An ``httpx.Client`` is not meant to be shared by
threads that block on it, so give a background membership poller its own ``HttpControlClient``,
sharing the first one's ``MemberCredential``: registration fills it in, and every client
holding it sends it with each request from then on.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import ssl
import time
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from bulkhead.api.protocol import (
    API_PREFIX,
    DELTA_BASE_HEADER,
    ENDPOINT_ENV,
    JOB_ENV,
    MEMBER_HEADER,
    TOKEN_ENV,
    WORKER_ENV,
    CompletionReport,
    Directive,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
    apply_membership_delta,
)

log = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class ControlError(RuntimeError):
    """The control endpoint could not be used."""


class ControlRequestError(ControlError):
    """The endpoint refused the request (4xx); ``status_code`` and the server's ``message``."""

    def __init__(self, status_code: int, message: str, route: str):
        super().__init__(f"{route}: HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.route = route


class ControlUnavailable(ControlError):
    """The endpoint did not answer usefully within the retries."""


class MemberCredential:
    """What a member proves itself with, shared by the clients of one worker process.

    ``claim`` is this process's registration secret (a retried registration presents it
    again); ``credential`` is what the manager answered registration with. Plain attribute
    writes: a client thread reads either the old or the new value, both usable.
    """

    def __init__(self) -> None:
        self.claim = secrets.token_urlsafe(24)
        self.credential: str | None = None

    def headers(self) -> dict[str, str]:
        return {MEMBER_HEADER: self.credential} if self.credential else {}


def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (its CA bundle, or SSL_CERT_FILE / SSL_CERT_DIR), made
    once per process: each httpx client made its own, loading the CA bundle every time
    (0.2 s of a trainer's start per client here, on a replacement's or a restart's path)."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.cache
def _tls_context(_cert_file: str | None, _cert_dir: str | None) -> ssl.SSLContext:
    # The variables are the cache key only: httpx reads them itself.
    return httpx.create_ssl_context()


class HttpControlClient:
    """Talks to the lifecycle manager for one worker of one job."""

    def __init__(
        self,
        url: str,
        token: str,
        job: str,
        worker: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 5,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        member: MemberCredential | None = None,
    ) -> None:
        """``member`` is shared by the clients of one worker process (default: this
        client's own)."""
        if not url:
            raise ControlError(f"no control endpoint URL (set {ENDPOINT_ENV})")
        if not job:
            raise ControlError(f"no job name (set {JOB_ENV})")
        self.job = job
        self.worker = worker
        self.member = member or MemberCredential()
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._prefix = f"{API_PREFIX}/{quote(job, safe='')}"
        # The last membership answer and its ETag: a poll that times out on a view this
        # client already holds is answered 304, without the member list.
        self._view: MembershipView | None = None
        self._view_etag: str | None = None
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=transport,
            verify=tls_context(),
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> HttpControlClient:
        """A client configured by the worker launch environment (BULKHEAD_CONTROL_URL, ...)."""
        env = os.environ if env is None else env
        missing = [k for k in (ENDPOINT_ENV, TOKEN_ENV, JOB_ENV) if not env.get(k)]
        if missing:
            raise ControlError(f"missing environment variables: {', '.join(missing)}")
        return cls(env[ENDPOINT_ENV], env[TOKEN_ENV], env[JOB_ENV], env.get(WORKER_ENV), **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpControlClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------ protocol

    def register(self, request: RegisterRequest) -> RegisterResponse:
        """Registers, and keeps the member credential the manager answers with."""
        if request.claim is None:
            request = request.model_copy(update={"claim": self.member.claim})
        response = self._call("POST", "register", RegisterResponse, body=request)
        if response.credential:
            self.member.credential = response.credential
        return response

    def membership(self, after: int = 0, timeout_s: float = 30.0) -> MembershipView:
        """Long poll: returns once a generation newer than ``after`` exists, or after
        ``timeout_s`` (possibly shortened by the server) with the current one.

        Asks for gzip (httpx decodes it) and sends the ETag of the view it holds, so an
        unchanged view costs a 304 and a changed one a delta against the held view instead
        of the whole member list.
        """
        params: dict[str, Any] = {"after": after, "timeout": timeout_s}
        if self.worker:
            params["worker"] = self.worker  # lets the hang timer see this worker is alive
        headers = {"If-None-Match": self._view_etag} if self._view_etag else None
        response = self._send(
            "GET",
            "membership",
            params=params,
            headers=headers,
            timeout_s=timeout_s + self.timeout_s,
        )
        if response.status_code == 304 and self._view is not None:
            return self._view
        base = response.headers.get(DELTA_BASE_HEADER)
        if base is not None:
            view = self._apply_delta(base, response)
            if view is None:  # not the view we hold: ask for the whole one, at once
                self._view = self._view_etag = None
                return self.membership(0, timeout_s)  # after=0: the current view, at once
        else:
            view = _parse(response, MembershipView, "membership")
        self._view, self._view_etag = view, response.headers.get("etag")
        return view

    def _apply_delta(self, base: str, response: httpx.Response) -> MembershipView | None:
        if self._view is None or base != self._view_etag:
            log.warning(
                "membership: a delta against %s, but this client holds %s", base, self._view_etag
            )
            return None
        try:
            return apply_membership_delta(self._view, response.json())
        except (ValueError, ValidationError) as exc:
            log.warning(
                "membership: a delta that does not apply (%s); fetching the whole view", exc
            )
            return None

    def progress(self, report: ProgressReport) -> Directive:
        return self._call("POST", "progress", Directive, body=report)

    def fault(self, report: FaultReport) -> Directive:
        return self._call("POST", "faults", Directive, body=report)

    def complete(self, report: CompletionReport) -> Directive:
        return self._call("POST", "complete", Directive, body=report)

    # ------------------------------------------------------------ transport

    def _call(
        self,
        method: str,
        route: str,
        response_model: type[T],
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> T:
        response = self._send(method, route, body=body, params=params, timeout_s=timeout_s)
        return _parse(response, response_model, route)

    def _send(
        self,
        method: str,
        route: str,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """The first answer that is not retryable (2xx, 3xx); 4xx raise, the rest retry."""
        url = f"{self._prefix}/{route}"
        headers = {**self.member.headers(), **(headers or {})}
        payload = body.model_dump(mode="json", by_alias=True) if body is not None else None
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_initial_s * 2 ** (attempt - 1), self.backoff_max_s)
                log.warning(
                    "control %s failed (%s); retry %d in %.1fs", route, last, attempt, delay
                )
                time.sleep(delay)
            try:
                response = self._http.request(
                    method,
                    url,
                    json=payload,
                    params=params,
                    headers=headers,
                    timeout=timeout_s or self.timeout_s,
                )
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in _RETRY_STATUS:
                last = f"HTTP {response.status_code}: {_message(response)}"
                continue
            if response.status_code >= 400:
                raise ControlRequestError(response.status_code, _message(response), route)
            return response
        raise ControlUnavailable(
            f"{route}: control endpoint unavailable after {self.retries + 1} attempts ({last})"
        )


def _parse(response: httpx.Response, response_model: type[T], route: str) -> T:
    try:
        return response_model.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        raise ControlError(f"{route}: malformed answer from the server: {exc}") from None


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return str(body)[:200]
