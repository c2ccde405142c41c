"""TrainingJob status models and the membership contract shared by operator and trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from bulkhead.api.spec import Model

Phase = Literal["Pending", "Running", "Recovering", "Succeeded", "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(Model):
    """One aspect of the job's state, in the Kubernetes condition convention."""

    type: str = Field(..., description="Valid, Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(..., description="True, False or Unknown.")
    reason: str = Field("", description="CamelCase reason for the last transition.")
    message: str = Field("", description="What happened, for people.")
    last_transition_time: str | None = Field(None, description="RFC 3339 time.")


class Member(Model):
    """One worker in the current generation."""

    rank: int = Field(
        ...,
        ge=0,
        description=(
            "Position in this generation; with G trainer processes per worker, process i "
            "holds torch.distributed rank G x position + i (ranks go node by node)."
        ),
    )
    worker: str = Field(..., min_length=1, description="Worker id (the pod name).")
    node: str = Field("", description="Node the worker runs on.")
    address: str = Field("", description="host:port the worker listens on, if any.")
    checkpoint_address: str = Field(
        "",
        description=(
            "host:port of the worker's checkpoint sidecar, for peer replicas; with several "
            "trainer processes, one per process, comma-separated in local-rank order."
        ),
    )

    def checkpoint_addresses(self, processes: int) -> list[str]:
        """The sidecar address of each of this worker's ``processes`` trainer processes
        ("" where none is known)."""
        given = self.checkpoint_address.split(",") if self.checkpoint_address else []
        return [given[i] if i < len(given) else "" for i in range(processes)]


class Membership(Model):
    """Who is in the job. Generations only grow; the lifecycle manager is the only writer."""

    generation: int = Field(
        0, ge=0, description="Membership generation: grows by one at each re-formation."
    )
    coordinator: str = Field("", description="host:port of rank 0's TCPStore.")
    members: list[Member] = Field(
        default_factory=list, description="The workers of this generation, by rank."
    )

    @property
    def world_size(self) -> int:
        return len(self.members)


class Recovery(Model):
    """One recovery: a fault detected and training resumed (or still pending)."""

    cause: str = Field(..., description="What was lost or went wrong (e.g. exited, hang).")
    detected: str = Field(..., description="RFC 3339 time the fault was detected.")
    resumed: str | None = Field(None, description="RFC 3339 time training resumed.")
    seconds: float | None = Field(
        None, ge=0, description="Detection to the next completed step; empty while pending."
    )


class TrainingJobStatus(Model):
    """What the operator observes and decided; written only by the operator."""

    phase: Phase = Field(
        "Pending", description="Pending, Running, Recovering, Succeeded or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Valid, Ready, Progressing and Degraded."
    )
    membership: Membership = Field(
        default_factory=Membership, description="The current generation and its members."
    )
    workers: str = Field(
        "", description="live/desired, and with spares ready/spares, for the printer column."
    )
    step: int = Field(0, ge=0, description="Last optimizer step completed (0-based).")
    loss: float | None = Field(None, description="Training loss of the last reported step.")
    val_loss: float | None = Field(
        None, description="Validation loss of the newest evaluation (spec.trainer.eval)."
    )
    last_checkpoint_step: int | None = Field(
        None, description="Newest step with a checkpoint snapshot, as workers report it."
    )
    last_persisted_step: int | None = Field(
        None,
        description="Newest step a worker persisted to storage: what a restart from storage "
        "resumes from (the CheckpointsPersisted condition says when persisting fails).",
    )
    restarts: int = Field(0, ge=0, description="Full restarts from checkpoint so far.")
    reconfigurations: int = Field(
        0, ge=0, description="In-process re-formations (new generations without a restart)."
    )
    evicted_nodes: list[str] = Field(
        default_factory=list, description="Nodes this job had cordoned and tainted."
    )
    recoveries: list[Recovery] = Field(
        default_factory=list, description="The newest recoveries (at most 50), oldest first."
    )
    observed_generation: int | None = Field(
        None, description="metadata.generation of the spec this status is about."
    )
    message: str = Field("", description="Why the job is in its phase, for people.")
