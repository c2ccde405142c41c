"""The job session on a real event loop: fast hang detection from who polls and who reported
collective errors, and open recoveries carried across a manager restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

from control_harness import RecordingDriver
from waiting import until

from bulkhead.api.protocol import FaultReport, ProgressReport, RegisterRequest
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Member, Membership, Recovery, TrainingJobStatus
from bulkhead.operator.lifecycle.types import WorkerExited
from bulkhead.operator.session.job import JobSession, open_new, open_resumed


def _spec(workers: int, **ft: object) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "minWorkers": 1,
            "trainer": {"steps": 50},
            "faultTolerance": {"maxFailures": 1, **ft},
        }
    )


def test_lone_silent_member_is_replaced_without_waiting_for_the_hang_timeout() -> None:
    async def scenario() -> None:
        driver = RecordingDriver()
        # A 10-minute hang timeout: only the fast path can act within the test's deadline.
        spec = _spec(3, hangTimeoutSeconds=600.0)
        opening = open_new("job", spec, suspect_grace_seconds=0.3)
        session = JobSession(opening, "t", lambda _: driver, tick_seconds=0.05)
        await session.start()
        for slot in range(3):
            await session.register(RegisterRequest(worker=f"job-w{slot}-0", address=f"h:{slot}"))
        await session.progress(ProgressReport(worker="job-w0-0", generation=1, step=0))

        async def keep_polling() -> None:  # w0: alive, waiting for the next generation
            while session.state.generation == 1:
                await session.wait_membership(after=1, timeout=0.2, worker="job-w0-0")

        poller = asyncio.create_task(keep_polling())
        try:
            await session.fault(
                FaultReport(worker="job-w1-0", generation=1, kind="collective_error")
            )
            await until(lambda: bool(driver.stopped))
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        (stopped,) = driver.stopped
        assert stopped[0] == "job-w2-0" and "peers reported" in stopped[1]
        await until(lambda: "job-w2-1" in driver.started)
        status = session.status
        assert [m.worker for m in status.membership.members] == ["job-w0-0", "job-w1-0"]
        assert status.recoveries[-1].cause == "hang"
        await session.stop()

    asyncio.run(scenario())


def test_open_recovery_survives_a_manager_restart() -> None:
    async def scenario() -> None:
        detected = datetime.fromtimestamp(time.time() - 30.0, UTC).isoformat()
        earlier = Recovery(
            cause="SIGKILL",
            detected="2026-01-01T00:00:00+00:00",
            resumed="2026-01-01T00:00:03+00:00",
            seconds=3.0,
        )
        status = TrainingJobStatus(
            phase="Recovering",
            step=20,
            loss=1.5,
            membership=Membership(
                generation=3,
                coordinator="h:0",
                members=[
                    Member(rank=0, worker="job-w0-0", address="h:0"),
                    Member(rank=1, worker="job-w1-0", address="h:1"),
                ],
            ),
            recoveries=[earlier, Recovery(cause="hang", detected=detected)],
        )
        driver = RecordingDriver()
        live = {"job-w0-0": "n0", "job-w1-0": "n1"}
        session = JobSession(open_resumed("job", _spec(2), status, live), "t", lambda _: driver)
        await session.start()
        open_ = session.status.recoveries
        assert [r.resumed is None for r in open_] == [False, True]  # restored, not duplicated
        directive = await session.progress(ProgressReport(worker="job-w0-0", generation=3, step=21))
        assert directive.action == "continue"
        recoveries = session.status.recoveries
        assert len(recoveries) == 2 and recoveries[0] == earlier
        closed = recoveries[1]
        assert closed.cause == "hang" and closed.resumed is not None
        assert closed.seconds is not None and closed.seconds >= 29.0
        assert session.status.phase == "Running"
        assert driver.started == [] and driver.stopped == []
        await session.stop()

    asyncio.run(scenario())


def test_workers_that_restored_nothing_after_a_persisted_step_fail_the_job_saying_so() -> None:
    """A manager that knows step 30 reached storage (from the status it resumed) hears the
    next generation start over from nothing: Failed, with a condition naming the missing step;
    never a Recovered Event claiming a checkpoint restore."""

    async def scenario() -> None:
        status = TrainingJobStatus(
            phase="Running",
            step=35,
            last_persisted_step=30,
            membership=Membership(
                generation=3,
                coordinator="h:0",
                members=[
                    Member(rank=0, worker="job-w0-0", address="h:0"),
                    Member(rank=1, worker="job-w1-0", address="h:1"),
                ],
            ),
        )
        driver = RecordingDriver()
        live = {"job-w0-0": "n0", "job-w1-0": "n1"}
        session = JobSession(open_resumed("job", _spec(2), status, live), "t", lambda _: driver)
        await session.start()
        # w1 dies: w0 goes on alone in a new generation, which finds no state to start from.
        session.observe(WorkerExited("job-w1-0", None, 9))
        generation = session.state.generation
        assert generation > 3 and session.status.phase != "Failed"
        directive = await session.progress(
            ProgressReport(worker="job-w0-0", generation=generation, step=0, state_source="fresh")
        )
        assert directive.action != "continue", directive
        await until(lambda: session.status.phase == "Failed")
        conditions = {c.type: c for c in session.status.conditions}
        lost = conditions["CheckpointsPersisted"]
        assert (lost.status, lost.reason) == ("False", "NotRestorable")
        assert "step 30 was persisted" in lost.message and "allowFreshStart" in lost.message
        assert not [e for e in driver.events if e[0] == "Recovered"]
        await session.stop()

    asyncio.run(scenario())


def test_after_a_fall_back_to_an_older_step_the_status_reports_that_step() -> None:
    """Step 20 was reported persisted, then found corrupt: the next generation restores
    step 10 and its workers report 10 as the newest complete step on storage. The status
    (and the metric) must say 10, not keep the 20 that cannot be restored."""

    async def scenario() -> None:
        driver = RecordingDriver()
        session = JobSession(open_new("job", _spec(2)), "t", lambda _: driver)
        await session.start()
        for slot in range(2):
            await session.register(RegisterRequest(worker=f"job-w{slot}-0", address=f"h:{slot}"))
        await session.progress(
            ProgressReport(worker="job-w0-0", generation=1, step=21, persisted_step=20)
        )
        await session.progress(  # a late, older figure of the same generation changes nothing
            ProgressReport(worker="job-w0-0", generation=1, step=22, persisted_step=15)
        )
        assert session.status.last_persisted_step == 20
        session.observe(WorkerExited("job-w1-0", None, 9))
        generation = session.state.generation
        assert generation > 1
        await session.progress(
            ProgressReport(
                worker="job-w0-0",
                generation=generation,
                step=11,
                state_source="checkpoint",
                persisted_step=10,
            )
        )
        assert session.status.last_persisted_step == 10
        await session.stop()

    asyncio.run(scenario())
