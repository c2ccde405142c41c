"""The agent's HTTP API (FastAPI): probes, Prometheus metrics, anomalies, worker reports.

- ``GET /healthz``   liveness: 503 when the detection loop has stopped ticking
- ``GET /readyz``    readiness: 200 once the first tick has run
- ``GET /metrics``   Prometheus text format (``bulkhead_agent_*``)
- ``GET /v1/anomalies``  the Node condition and active problems (the agents' token)
- ``POST /v1/jobs/{job}/report``  a ``WorkerReport`` from a trainer of job ``job`` on this
  node, with that job's own token (``job_report_token``): checked before the body is read,
  and the body is read as it streams (chunked too) and refused past ``MAX_REPORT_BYTES``;
  a report of a new worker while the agent already watches ``MAX_WORKERS`` gets 429

Workers are known as ``<job>/<worker>``, so two jobs' workers of the same name (jobs of one
name in two namespaces) never share a state.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from bulkhead.agent.agent import Agent
from bulkhead.agent.reporters.metrics import AgentMetrics
from bulkhead.agent.tokens import AgentTokens
from bulkhead.api.protocol import AGENT_REPORT_PATH, WorkerReport

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 64 * 1024


def _json_safe(value: Any) -> Any:
    """Replace NaN/inf (not valid JSON) by strings in an outgoing payload."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def of_job(job: str, report: WorkerReport) -> WorkerReport:
    """``report`` with every worker named ``<job>/<worker>``."""
    return report.model_copy(
        update={
            "worker": f"{job}/{report.worker}",
            "stragglers": [f"{job}/{w}" for w in report.stragglers],
            "straggler_scores": {f"{job}/{w}": v for w, v in report.straggler_scores.items()},
        }
    )


async def _bounded_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it passes ``limit`` bytes: read as it streams, so a
    chunked body (no Content-Length) is refused without being held whole."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _refused(
    request: Request, tokens: AgentTokens, job: str | None = None
) -> tuple[int, str] | None:
    """Why the request may not go on (status, detail), or None when its token is good:
    the agents' token, or for ``job`` that job's own (see ``AgentTokens``)."""
    disabled = 403, "the agent API is disabled: the agent has no token"
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return disabled if tokens.current is None else (401, "missing bearer token")
    if not tokens.admits(given, job):
        return disabled if tokens.current is None else (403, "invalid token")
    return None


def _anomalies(agent: Agent, node: str) -> dict[str, Any]:
    """The body of ``GET /v1/anomalies``: the Node condition and the active problems."""
    condition = agent.health.view
    return {
        "node": node,
        "condition": {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "since": condition.since,
        },
        "problems": [p.as_dict() for p in agent.problems()],
    }


async def _read_report(request: Request) -> WorkerReport | tuple[int, Any]:
    """The ``WorkerReport`` in the request's body, or why it is refused (status, detail)."""
    too_large = f"report larger than {MAX_REPORT_BYTES} bytes"
    declared = request.headers.get("content-length") or "0"
    if not declared.isdigit():
        return 400, f"bad Content-Length {declared[:32]!r}"
    if int(declared) > MAX_REPORT_BYTES:
        return 413, too_large
    body = await _bounded_body(request, MAX_REPORT_BYTES)
    if body is None:
        return 413, too_large
    try:
        return WorkerReport.model_validate_json(body)
    except ValidationError as exc:
        return 422, [
            {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()
        ]


def create_app(
    agent: Agent,
    metrics: AgentMetrics,
    node: str,
    tokens: AgentTokens,
    stale_after_s: float,
) -> FastAPI:
    """``stale_after_s``: liveness fails when no tick completed for that long."""
    app = FastAPI(title="bulkhead-agent", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        last = agent.last_tick
        if last is not None and agent.clock() - last > stale_after_s:
            return JSONResponse({"status": "stalled", "lastTick": last}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        if agent.last_tick is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/anomalies")
    def anomalies(request: Request) -> JSONResponse:
        denied = _refused(request, tokens)
        if denied is not None:
            return JSONResponse({"detail": denied[1]}, status_code=denied[0])
        return JSONResponse(_json_safe(_anomalies(agent, node)))

    @app.post(AGENT_REPORT_PATH)
    async def report(job: str, request: Request) -> JSONResponse:
        def reject(status: int, detail: Any) -> JSONResponse:
            metrics.reports.labels("rejected").inc()
            log.info("report for job %s rejected (%d): %s", job, status, str(detail)[:200])
            # Closing the connection stops the server reading (and discarding) the rest of
            # an oversized or refused body.
            return JSONResponse(
                {"detail": detail}, status_code=status, headers={"Connection": "close"}
            )

        denied = _refused(request, tokens, job)
        if denied is not None:
            return reject(*denied)
        parsed = await _read_report(request)
        if not isinstance(parsed, WorkerReport):
            return reject(*parsed)
        if not agent.record_report(of_job(job, parsed)):
            return reject(429, "this agent watches as many workers as it may; report refused")
        metrics.reports.labels("accepted").inc()
        return JSONResponse({"accepted": True, "worker": parsed.worker}, status_code=202)

    return app
