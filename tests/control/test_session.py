"""The job session on a real event loop: hang timer, rebuild after a restart, driver errors."""

from __future__ import annotations

import asyncio
import contextlib

from control_harness import RecordingDriver
from waiting import until

from bulkhead.api.protocol import ProgressReport, RegisterRequest
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Member, Membership, TrainingJobStatus
from bulkhead.operator.lifecycle.rebuild import GENERATION_SKIP
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.session.job import JobSession, open_new, open_resumed


def _spec(workers: int = 2, **ft: object) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "minWorkers": 1,
            "trainer": {"steps": 50},
            "faultTolerance": {"maxFailures": min(1, workers - 1), **ft},
        }
    )


def test_hang_timer_stops_the_silent_worker_and_keeps_the_polling_one() -> None:
    async def scenario() -> None:
        driver = RecordingDriver()
        session = JobSession(
            open_new("job", _spec(hangTimeoutSeconds=3.0)), "t", lambda _: driver, tick_seconds=0.05
        )
        await session.start()
        for slot in range(2):
            await session.register(RegisterRequest(worker=f"job-w{slot}-0", address=f"h:{slot}"))
        await session.progress(ProgressReport(worker="job-w0-0", generation=1, step=0))

        async def keep_polling() -> None:  # w0 is alive (waiting on a collective, say)
            while session.state.phase != "Failed":
                gen = session.state.generation
                await session.wait_membership(after=gen, timeout=0.2, worker="job-w0-0")

        poller = asyncio.create_task(keep_polling())
        try:
            await until(lambda: any(w == "job-w1-0" for w, _ in driver.stopped))
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        assert [w for w, _ in driver.stopped] == ["job-w1-0"]
        assert "hang" in driver.stopped[0][1]
        assert "job-w1-1" in driver.started
        status = session.status
        assert status.membership.generation == 2
        assert [m.worker for m in status.membership.members] == ["job-w0-0"]
        assert status.phase == "Recovering" and status.recoveries[-1].cause == "hang"
        await session.stop()

    asyncio.run(scenario())


def test_session_resumes_from_a_persisted_status() -> None:
    async def scenario() -> None:
        status = TrainingJobStatus(
            phase="Running",
            step=20,
            restarts=1,
            membership=Membership(
                generation=3,
                coordinator="h:0",
                members=[
                    Member(rank=0, worker="job-w0-1", address="h:0"),
                    Member(rank=1, worker="job-w1-0", address="h:1"),
                ],
            ),
        )
        driver = RecordingDriver()
        opening = open_resumed("job", _spec(), status, {"job-w0-1": "n0"})
        session = JobSession(opening, "t", lambda _: driver)
        await session.start()
        await until(lambda: driver.started == ["job-w1-1"])
        view = await session.wait_membership(after=3, timeout=1.0)
        # The first generation after a manager restart skips ahead (see GENERATION_SKIP).
        first = 3 + GENERATION_SKIP
        assert view.generation == first and [m.worker for m in view.members] == ["job-w0-1"]
        assert session.status.restarts == 1
        # The survivor goes on reporting in the new generation.
        directive = await session.progress(ProgressReport(worker="job-w0-1", generation=3, step=21))
        assert directive.action == "reconfigure"
        await until(
            lambda: bool(driver.statuses) and driver.statuses[-1].membership.generation == first
        )
        await session.stop()

    asyncio.run(scenario())


class _BrokenDriver(RecordingDriver):
    async def start_worker(self, worker: WorkerRef) -> None:
        self.started.append(worker.id)
        raise RuntimeError("quota exceeded")


def test_start_failures_are_workers_that_died() -> None:
    async def scenario() -> None:
        driver = _BrokenDriver()
        spec = _spec(workers=1, maxRestarts=0, backoff={"initialSeconds": 0.05})
        session = JobSession(open_new("job", spec), "t", lambda _: driver, tick_seconds=0.05)
        await session.start()
        phase = await session.wait_done(timeout=20)
        await until(lambda: len(driver.started) == 2)
        assert phase == "Failed"
        assert "StartFailed: quota exceeded" in session.status.message
        assert driver.started == ["job-w0-0", "job-w0-1"]
        await session.stop()

    asyncio.run(scenario())
