"""Shared helpers of the lifecycle policy tests: a spec builder and an event driver."""

from __future__ import annotations

from typing import Any

from bulkhead.api.protocol import CompletionReport, FaultReport, ProgressReport
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.lifecycle.policy import decide, initial_state
from bulkhead.operator.lifecycle.types import (
    CompletionReported,
    Decision,
    Event,
    FaultReported,
    JobStarted,
    LifecycleState,
    ProgressReported,
    PublishMembership,
    Tick,
    WorkerExited,
    WorkerRegistered,
)


def make_spec(workers: int = 4, processes: int = 1, **fault_tolerance: Any) -> TrainingJobSpec:
    """``processes``: trainer processes per worker pod (more than one: pods with launchers)."""
    ft = {"maxFailures": 1, "maxRestarts": 2, "hangTimeoutSeconds": 10.0}
    ft.update(fault_tolerance)
    return TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "minWorkers": min(2, workers),
            **({"processesPerWorker": processes} if processes > 1 else {}),
            "trainer": {"steps": 100},
            "faultTolerance": ft,
        }
    )


class Sim:
    """Feeds events to the policy with a manual clock and keeps every decision."""

    def __init__(
        self, spec: TrainingJobSpec | None = None, job: str = "job", pods_launch: bool | None = None
    ):
        self.state: LifecycleState = initial_state(job, spec or make_spec(), None, pods_launch)
        self.now = 0.0
        self.log: list[Decision] = []

    def feed(self, event: Event, advance: float = 0.0) -> list[Decision]:
        self.now += advance
        self.state, decisions = decide(self.state, event, self.now)
        self.log.extend(decisions)
        return decisions

    def wid(self, slot: int) -> str:
        current = self.state.slots[slot]
        return self.state.ref(current).id

    def start_and_register_all(self) -> None:
        self.feed(JobStarted())
        for slot in range(len(self.state.slots)):
            self.feed(
                WorkerRegistered(
                    self.wid(slot),
                    f"node-{slot}",
                    f"127.0.0.1:{9000 + slot}",
                    checkpoint_address=f"127.0.0.1:{29700 + slot}",
                )
            )

    def progress(
        self,
        step: int,
        worker: str | None = None,
        advance: float = 1.0,
        checkpoint: int | None = None,
        persisted: int | None = None,
        persist_error: str | None = None,
        plan: list[str] | None = None,
        state_source: str | None = None,
    ) -> None:
        worker = worker or self.state.members()[0]
        report = ProgressReport(
            worker=worker,
            generation=self.state.generation,
            step=step,
            loss=1.0,
            checkpoint_step=checkpoint,
            persisted_step=persisted,
            persist_error=persist_error,
            plan=plan,
            state_source=state_source,
        )
        self.feed(ProgressReported(report), advance)

    def exit(self, worker: str, code: int | None = None, sig: int | None = 9) -> list[Decision]:
        return self.feed(WorkerExited(worker, code, sig if code is None else None))

    def fault(self, worker: str, kind: str, suspects: list[str] | None = None) -> list[Decision]:
        report = FaultReport(
            worker=worker, generation=self.state.generation, kind=kind, suspects=suspects or []
        )
        return self.feed(FaultReported(report))

    def complete(
        self, step: int, workers: list[str] | None = None, generation: int | None = None
    ) -> list[Decision]:
        """Completion reports from ``workers`` (default: every member) of ``generation``
        (default: the current one)."""
        decisions: list[Decision] = []
        generation = generation if generation is not None else self.state.generation
        for worker in workers if workers is not None else self.state.members():
            report = CompletionReport(worker=worker, generation=generation, step=step)
            decisions += self.feed(CompletionReported(report))
        return decisions

    def tick(self, advance: float, last_seen: dict[str, float] | None = None) -> list[Decision]:
        return self.feed(Tick(last_seen=last_seen or {}), advance)

    def published(self) -> list[PublishMembership]:
        return [d for d in self.log if isinstance(d, PublishMembership)]
