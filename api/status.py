"""TrainingJob status models and the membership contract shared by operator and trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from bulkhead.api.spec import Model

Phase = Literal["Pending", "Running", "Recovering", "Succeeded", "Failed"]
ConditionType = Literal["Valid", "Ready", "Progressing", "Degraded"]
ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(Model):
    type: str
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = Field(None, description="RFC 3339 time.")


class Member(Model):
    rank: int = Field(..., ge=0)
    worker: str = Field(..., min_length=1, description="Worker id (the pod name).")
    node: str = Field("", description="Node the worker runs on.")
    address: str = Field("", description="host:port the worker listens on, if any.")
    checkpoint_address: str = Field(
        "", description="host:port of the worker's checkpoint sidecar, for peer replicas."
    )


class Membership(Model):
    """Who is in the job. Generations only grow; the lifecycle manager is the only writer."""

    generation: int = Field(0, ge=0)
    coordinator: str = Field("", description="host:port of rank 0's TCPStore.")
    members: list[Member] = Field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.members)


class Recovery(Model):
    cause: str
    detected: str = Field(..., description="RFC 3339 time the fault was detected.")
    resumed: str | None = Field(None, description="RFC 3339 time training resumed.")
    seconds: float | None = Field(None, ge=0)


class TrainingJobStatus(Model):
    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    membership: Membership = Field(default_factory=Membership)
    workers: str = Field("", description="live/desired, for the printer column.")
    step: int = Field(0, ge=0)
    loss: float | None = None
    last_checkpoint_step: int | None = None
    restarts: int = Field(0, ge=0)
    reconfigurations: int = Field(0, ge=0)
    evicted_nodes: list[str] = Field(default_factory=list)
    recoveries: list[Recovery] = Field(default_factory=list)
    observed_generation: int | None = None
    message: str = ""
