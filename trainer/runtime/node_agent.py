"""Reports to this node's agent: step, loss, step time, throughput, stragglers.

The agent (a DaemonSet, ``bulkhead.agent``) turns them into the training-side anomalies of
its node: a hang, a NaN loss, a straggler. Reports go out from a daemon thread through a
small queue, so a slow or absent agent never slows training down; a full queue drops its
oldest report, which the newer ones supersede. Configured by the launch
environment (``BULKHEAD_AGENT_URL``, ``BULKHEAD_AGENT_TOKEN``); without a URL (local mode)
there is no reporter.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Mapping
from urllib.parse import quote

import httpx

from bulkhead.api.client import tls_context
from bulkhead.api.protocol import (
    AGENT_REPORT_PATH,
    AGENT_TOKEN_ENV,
    AGENT_URL_ENV,
    JOB_ENV,
    WorkerReport,
)

log = logging.getLogger(__name__)


class NodeAgentReporter:
    """Posts job ``job``'s ``WorkerReport``s to ``{url}/v1/jobs/{job}/report`` in the
    background, with the job's own report token."""

    def __init__(
        self,
        url: str,
        job: str,
        token: str | None,
        timeout_s: float = 2.0,
        queue_size: int = 16,
    ) -> None:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = url.rstrip("/") + AGENT_REPORT_PATH.format(job=quote(job, safe=""))
        self._http = httpx.Client(headers=headers, timeout=timeout_s, verify=tls_context())
        self._queue: queue.Queue[WorkerReport | None] = queue.Queue(maxsize=queue_size)
        self._failing = False
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="node-agent-reporter", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NodeAgentReporter | None:
        url = env.get(AGENT_URL_ENV)
        if not url:
            log.info("no node agent (%s unset): reports go to the manager only", AGENT_URL_ENV)
            return None
        return cls(url, env[JOB_ENV], env.get(AGENT_TOKEN_ENV) or None)

    def post(self, report: WorkerReport) -> None:
        """Queue ``report``; never blocks."""
        while True:
            try:
                self._queue.put_nowait(report)
                return
            except queue.Full:
                # The agent is slow: drop the oldest, the newer reports supersede it.
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then stop."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return  # the agent hangs: the daemon thread dies with the process
        self._thread.join(timeout_s)
        self._http.close()

    def _run(self) -> None:
        while (report := self._queue.get()) is not None:
            body = report.model_dump_json(by_alias=True, exclude_none=True)
            try:
                response = self._http.post(self.url, content=body)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                # Once per outage: an agent that is down must not flood the worker's log.
                if not self._failing:
                    log.warning("node agent at %s: %s (reports continue)", self.url, exc)
                self._failing = True
                continue
            if self._failing:
                log.info("node agent at %s answers again", self.url)
            self._failing = False
            self.sent += 1
