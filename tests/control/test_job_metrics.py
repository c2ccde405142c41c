"""The per-job ``bulkhead_job_*`` series a session exports, read back from the exposition.

A real session (recording driver, manual clock) trains, loses a worker, re-forms and
resumes; the test parses ``/metrics`` text as Prometheus would and checks the series'
names, labels and values, then that stopping the session removes them.
"""

from __future__ import annotations

import asyncio

from control_harness import RecordingDriver
from prometheus_client.parser import text_string_to_metric_families

from bulkhead.api.protocol import CompletionReport, ProgressReport, RegisterRequest, StepFigures
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator import metrics
from bulkhead.operator.lifecycle.types import WorkerExited
from bulkhead.operator.session.job import JobSession, open_new

LABELS = {"namespace": "team-a", "job": "llm"}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry carrying this test's job labels, by name and labels."""
    text = metrics.exposition()[0].decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in LABELS.items()):
                rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in LABELS))
                found[(sample.name, rest)] = sample.value
    return found


def _session(spec: TrainingJobSpec, clock: Clock) -> JobSession[RecordingDriver]:
    """A session of job ``team-a.llm`` on the manual clock, with a recording driver."""
    driver = RecordingDriver()
    return JobSession(
        open_new("team-a.llm", spec, clock=clock),
        "t",
        lambda _: driver,
        clock=clock,
        tick_seconds=60,
        namespace="team-a",
    )


def test_a_session_exports_its_training_and_recovery_series() -> None:
    async def scenario() -> None:
        clock = Clock()
        spec = TrainingJobSpec.model_validate(
            {
                "workers": 2,
                "minWorkers": 1,
                "trainer": {"steps": 100},
                "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 600},
            }
        )
        session = _session(spec, clock)
        await session.start()
        w0, w1 = (session.state.ref(s).id for s in session.state.slots)
        for i, w in enumerate((w0, w1)):
            await session.register(RegisterRequest(worker=w, address=f"h:{i}"))
        assert session.state.generation == 1
        # Steps of 100 tokens every 0.5 s on the manager clock: 200 tokens/s for the job,
        # though each worker reports its own 1000 tokens/s (100 tokens in 0.1 s of compute).
        for step in range(4):
            clock.t += 0.5
            for w in (w0, w1):
                await session.progress(
                    ProgressReport(
                        worker=w,
                        generation=1,
                        step=step,
                        loss=3.0 - step / 10,
                        step_time_s=0.1,
                        tokens_per_s=1000.0,
                        checkpoint_step=2 if step >= 2 else None,
                    )
                )
        s = _samples()
        assert s[("bulkhead_job_step", ())] == 3
        assert s[("bulkhead_job_loss", ())] == 2.7
        assert s[("bulkhead_job_tokens_per_second", ())] == 200.0
        assert s[("bulkhead_job_step_duration_seconds", ())] == 0.1
        assert s[("bulkhead_job_workers_live", ())] == 2
        assert s[("bulkhead_job_workers_desired", ())] == 2
        assert s[("bulkhead_job_membership_generation", ())] == 1
        assert s[("bulkhead_job_last_snapshot_step", ())] == 2
        assert s[("bulkhead_job_phase", (("phase", "Running"),))] == 1
        assert s[("bulkhead_job_phase", (("phase", "Recovering"),))] == 0
        assert s[("bulkhead_job_restarts_total", ())] == 0
        assert s[("bulkhead_job_lost_steps_total", ())] == 0

        # w1's process exits: the job re-forms around w0 and resumes 1.5 s later.
        clock.t += 0.5
        session.observe(WorkerExited(w1, reason="Error: exit code 1"))
        assert session.state.phase == "Recovering"
        assert _samples()[("bulkhead_job_phase", (("phase", "Recovering"),))] == 1
        assert session.state.generation == 2
        clock.t += 1.5
        await session.progress(ProgressReport(worker=w0, generation=2, step=4, loss=2.6))
        s = _samples()
        assert s[("bulkhead_job_phase", (("phase", "Running"),))] == 1
        assert s[("bulkhead_job_membership_generation", ())] == 2
        assert s[("bulkhead_job_workers_live", ())] == 1
        assert s[("bulkhead_job_step", ())] == 4
        cause = session.status.recoveries[-1].cause
        assert s[("bulkhead_job_recoveries_total", (("cause", cause),))] == 1
        assert s[("bulkhead_job_recovery_duration_seconds_count", (("cause", cause),))] == 1
        assert s[("bulkhead_job_recovery_duration_seconds_sum", (("cause", cause),))] == 1.5
        assert (
            s[("bulkhead_job_recovery_duration_seconds_bucket", (("cause", cause), ("le", "1.0")))]
            == 0
        )
        assert (
            s[("bulkhead_job_recovery_duration_seconds_bucket", (("cause", cause), ("le", "2.0")))]
            == 1
        )

        # No label beyond namespace/job/phase/cause/le: cardinality stays per job.
        assert {k for _, rest in s for k, _ in rest} <= {"phase", "cause", "le"}

        await session.stop()
        assert _samples() == {}
        # A report after the stop does not bring the series back.
        await session.progress(ProgressReport(worker=w0, generation=2, step=5, loss=2.5))
        assert _samples() == {}

    asyncio.run(scenario())


def test_a_report_carrying_several_steps_dates_each_by_its_age() -> None:
    """One request with steps 0..3 (as a worker sends at its report interval) gives the
    job's series what four requests 0.5 s apart gave; a watched step reaches the worker."""

    async def scenario() -> None:
        clock = Clock()
        spec = TrainingJobSpec.model_validate(
            {"workers": 1, "trainer": {"steps": 100}, "faultTolerance": {"hangTimeoutSeconds": 600}}
        )
        session = _session(spec, clock)
        session.watch_step(lambda: 40)
        await session.start()
        (w0,) = (session.state.ref(s).id for s in session.state.slots)
        await session.register(RegisterRequest(worker=w0, address="h:0"))
        clock.t += 2.0
        figures = dict(step_time_s=0.1, tokens_per_s=1000.0)
        directive = await session.progress(
            ProgressReport(
                worker=w0,
                generation=1,
                step=3,
                loss=2.7,
                **figures,
                earlier=[
                    StepFigures(step=s, loss=3.0 - s / 10, age_s=1.5 - s / 2, **figures)
                    for s in range(3)
                ],
            )
        )
        assert directive.action == "continue" and directive.report_step == 40
        s = _samples()
        assert s[("bulkhead_job_step", ())] == 3
        assert s[("bulkhead_job_loss", ())] == 2.7
        assert s[("bulkhead_job_tokens_per_second", ())] == 200.0
        await session.stop()

    asyncio.run(scenario())


def test_a_validation_loss_reaches_the_status_and_its_series() -> None:
    """An evaluation's loss, carried with the step it followed (also among ``earlier``
    steps), is the status' valLoss and ``bulkhead_job_val_loss`` until the next one; an
    evaluation the next generation redoes for the same step still counts."""

    async def scenario() -> None:
        clock = Clock()
        spec = TrainingJobSpec.model_validate(
            {
                "workers": 2,
                "minWorkers": 1,
                "trainer": {"steps": 100, "eval": {"intervalSteps": 2}},
                "faultTolerance": {"maxFailures": 1, "hangTimeoutSeconds": 600},
            }
        )
        session = _session(spec, clock)
        await session.start()
        w0, w1 = (session.state.ref(s).id for s in session.state.slots)
        for i, w in enumerate((w0, w1)):
            await session.register(RegisterRequest(worker=w, address=f"h:{i}"))
        await session.progress(ProgressReport(worker=w0, generation=1, step=0, loss=3.0))
        assert session.status.val_loss is None
        assert ("bulkhead_job_val_loss", ()) not in _samples()
        # Steps 1..2 in one request: step 1 evaluated (among ``earlier``), step 2 not.
        clock.t += 1.0
        earlier = [StepFigures(step=1, loss=2.9, val_loss=3.25)]
        await session.progress(
            ProgressReport(worker=w0, generation=1, step=2, loss=2.8, earlier=earlier)
        )
        assert session.status.val_loss == 3.25
        assert session.status.wire()["valLoss"] == 3.25  # the printer column's path
        assert _samples()[("bulkhead_job_val_loss", ())] == 3.25
        # w1 dies during the evaluation after step 3 (a step is reported after its
        # evaluation): the next generation redoes it and reports step 3 with it.
        session.observe(WorkerExited(w1, reason="Error: exit code 1"))
        assert session.state.generation == 2
        await session.progress(
            ProgressReport(worker=w0, generation=2, step=3, loss=2.7, val_loss=3.0)
        )
        assert session.status.val_loss == 3.0 and session.status.loss == 2.7
        assert session.state.phase == "Running" and session.state.lost_steps == 0
        assert _samples()[("bulkhead_job_val_loss", ())] == 3.0
        await session.stop()

    asyncio.run(scenario())


def test_the_last_evaluation_counts_when_another_rank_completes_first() -> None:
    """Rank 0 reports the last step (and its evaluation) after a rank that reports no
    progress has already sent its completion for that step."""

    async def scenario() -> None:
        clock = Clock()
        spec = TrainingJobSpec.model_validate(
            {
                "workers": 2,
                "trainer": {"steps": 2, "eval": {"intervalSteps": 2}},
                "faultTolerance": {"hangTimeoutSeconds": 600},
            }
        )
        session = _session(spec, clock)
        await session.start()
        w0, w1 = (session.state.ref(s).id for s in session.state.slots)
        for i, w in enumerate((w0, w1)):
            await session.register(RegisterRequest(worker=w, address=f"h:{i}"))
        await session.progress(ProgressReport(worker=w0, generation=1, step=0, loss=3.0))
        await session.complete(CompletionReport(worker=w1, generation=1, step=1, loss=2.9))
        await session.progress(
            ProgressReport(worker=w0, generation=1, step=1, loss=2.9, val_loss=2.5)
        )
        await session.complete(CompletionReport(worker=w0, generation=1, step=1, loss=2.9))
        assert session.status.phase == "Succeeded"
        assert session.status.val_loss == 2.5
        await session.stop()

    asyncio.run(scenario())
