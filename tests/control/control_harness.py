"""A real control endpoint on 127.0.0.1 in a background event loop, for the control tests.

The driver records what the session asked for (starting real workers is the local
driver's job, tested in tests/local); everything else is the production code path.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from waiting import wait_until

from bulkhead.api.client import HttpControlClient, MemberCredential
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.control import ControlServer, create_control_app
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.session.job import JobSession, Opening, SessionRegistry, open_new


class RecordingDriver:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[tuple[str, str]] = []
        self.evicted: list[str] = []
        self.events: list[tuple[str, str, bool]] = []
        self.statuses: list[TrainingJobStatus] = []

    async def start_worker(self, worker: WorkerRef) -> None:
        self.started.append(worker.id)

    async def stop_worker(self, worker: WorkerRef, reason: str) -> None:
        self.stopped.append((worker.id, reason))

    async def evict_node(self, node: str, reason: str) -> None:
        self.evicted.append(node)

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append((reason, message, warning))

    async def publish_status(self, status: TrainingJobStatus) -> None:
        self.statuses.append(status)


class Harness:
    """One job session behind a real HTTP server, on its own thread and event loop."""

    def __init__(
        self,
        job: str,
        spec: TrainingJobSpec,
        token: str = "s3cret",
        *,
        opening: Opening | None = None,
        member_key: str | None = None,
    ) -> None:
        """A new job, or ``opening`` (a job a restarted manager resumes, ``open_resumed``)
        whose earlier credentials ``member_key`` signed."""
        self.job = job
        self.token = token
        self.stored_token = token  # where the session re-reads it (a rotation changes it)
        self.token_reads = 0
        self.driver = RecordingDriver()
        self.loop = asyncio.new_event_loop()
        self.session = JobSession(
            opening or open_new(job, spec),
            token,
            lambda _: self.driver,
            tick_seconds=0.1,
            member_key=member_key,
            token_source=self._read_token,
        )
        self.registry = SessionRegistry()
        self.registry.add(self.session)
        self.app = create_control_app(self.registry)
        self.server = ControlServer(self.app)
        self.url = self.server.url
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._members: dict[str, MemberCredential] = {}

    async def _read_token(self) -> str:
        self.token_reads += 1
        return self.stored_token

    def client(
        self, worker: str | None = None, token: str | None = None, **kwargs: Any
    ) -> HttpControlClient:
        """A client of ``worker``, holding the credential its registration got (one per
        worker, as one worker process's clients share theirs), with the job token it was
        started with (default: the first)."""
        member = self._members.setdefault(worker, MemberCredential()) if worker else None
        return HttpControlClient(
            self.url, token or self.token, self.job, worker, member=member, **kwargs
        )

    def __enter__(self) -> Harness:
        self._thread.start()
        self.call(self.session.start())
        self.call(self.server.start())
        return self

    def __exit__(self, *_: object) -> None:
        self.call(self.session.stop())
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 20.0) -> None:
        wait_until(condition, "condition", timeout)
