"""The control protocol between workers and the lifecycle manager (HTTP + JSON).

The same protocol runs in Kubernetes (the operator serves it) and in local mode (the
supervisor serves it). Every request carries ``Authorization: Bearer <job token>``.
Registration answers the worker with its *member credential*; every report and every
membership poll naming a worker carries it as ``X-Bulkhead-Member: <credential>`` (the job
token alone cannot speak for a member, so one worker cannot report for another).

Routes (``{job}`` is the TrainingJob name; namespaced jobs use ``namespace.name``):

- ``POST /v1/jobs/{job}/register``        RegisterRequest   -> RegisterResponse
- ``GET  /v1/jobs/{job}/membership?after=G&timeout=S&worker=W``  -> MembershipView
  (long poll: answers as soon as a generation > G is published, or after S seconds,
  capped by the server, with the current one). The answer carries
  ``ETag: "g<generation>-<state>"``; a poll sent with ``If-None-Match`` equal to the
  current view's ETag that times out gets ``304`` and no body. Every view is encoded
  once and sent gzip-compressed to clients that accept it. An open poll naming its
  ``worker`` keeps that worker alive to the hang timer. When the ``If-None-Match`` view
  is a recent one of this job, the answer is a *delta* against it (header
  ``X-Bulkhead-Delta-Base: <its ETag>``, body ``membership_delta``): a one-member change
  costs a few hundred bytes instead of the whole list.
- ``POST /v1/jobs/{job}/progress``        ProgressReport    -> Directive
  (rank 0 of the generation reports for the job: every rank completes the same steps)
- ``POST /v1/jobs/{job}/faults``          FaultReport       -> Directive
- ``POST /v1/jobs/{job}/complete``        CompletionReport  -> Directive

A worker also reports to its node's agent (``WorkerReport`` to ``$BULKHEAD_AGENT_URL``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
from collections.abc import Mapping
from enum import IntEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from bulkhead.api.spec import Model
from bulkhead.api.status import Member, Membership

API_PREFIX = "/v1/jobs"
TOKEN_ENV = "BULKHEAD_CONTROL_TOKEN"
# The token checkpoint sidecars (and trainers restoring from peers) show each other on the
# replica port. It is not the job token: rotating that (a new token for new pods) must not
# split the job's pods into two groups that refuse each other's replicas, and the job token
# alone then opens no replica. Unset (local mode, jobs started before it existed): the job
# token (``replica_token``).
REPLICA_TOKEN_ENV = "BULKHEAD_REPLICA_TOKEN"
ENDPOINT_ENV = "BULKHEAD_CONTROL_URL"
JOB_ENV = "BULKHEAD_JOB"
WORKER_ENV = "BULKHEAD_WORKER"
# The rest of the environment a worker process is started with (both drivers set it;
# trainer/worker.py reads it).
INCARNATION_ENV = "BULKHEAD_INCARNATION"
NODE_ENV = "BULKHEAD_NODE"
ADVERTISE_HOST_ENV = "BULKHEAD_ADVERTISE_HOST"
JOB_SPEC_ENV = "BULKHEAD_JOB_SPEC"
RUN_DIR_ENV = "BULKHEAD_RUN_DIR"
# Set by the pod's launcher on each of its trainer processes (0..G-1); unset = the launcher,
# or the only process of a one-process pod.
LOCAL_RANK_ENV = "BULKHEAD_LOCAL_RANK"
SHM_DIR_ENV = "BULKHEAD_SHM_DIR"
# Set ("1") on a Kubernetes worker pod's trainer container: its first process is the pod's
# launcher even with one trainer process, so that a crashed process is replaced in place
# by one forked from the launcher's template and the pod is kept. Local mode leaves it
# unset: its driver keeps the template, and a worker with one process runs it directly.
POD_LAUNCHER_ENV = "BULKHEAD_POD_LAUNCHER"
# A worker forked from a template (``bulkhead.trainer.pod.prestart``) is given its launch
# environment in the fork request; this one names the log file it then writes to.
LOG_FILE_ENV = "BULKHEAD_LOG_FILE"
CHECKPOINT_SOCKET_ENV = "BULKHEAD_CHECKPOINT_SOCKET"
# The checkpoint sidecar's TCP port for peer replicas (in the pod; local mode picks any).
CHECKPOINT_REPLICA_PORT = 29700
# With G trainer processes per pod the sidecar serves each on its own port, from
# CHECKPOINT_REPLICA_PORT up (process i on CHECKPOINT_REPLICA_PORT + i).
CHECKPOINT_LOCAL_RANKS_ENV = "BULKHEAD_CHECKPOINT_LOCAL_RANKS"
# The checkpoint sidecar's Prometheus port in a worker pod (off in local mode).
CHECKPOINT_METRICS_PORT = 29699
CHECKPOINT_METRICS_PORT_ENV = "BULKHEAD_CHECKPOINT_METRICS_PORT"
# Where a worker pod mounts spec.checkpoint.storage.pvc when no path is given: the operator
# mounts it here and the checkpoint engine persists here (one definition for both).
CHECKPOINT_PVC_MOUNT = "/bulkhead/checkpoints"
# Where a worker reports to its node's agent (``POST`` a ``WorkerReport`` to
# ``AGENT_REPORT_PATH``); unset = no agent (local mode). The agent listens on the node's IP
# (hostPort). AGENT_TOKEN_ENV holds the job's own report token (``job_report_token``).
AGENT_URL_ENV = "BULKHEAD_AGENT_URL"
AGENT_TOKEN_ENV = "BULKHEAD_AGENT_TOKEN"
AGENT_PORT = 9402
AGENT_REPORT_PATH = "/v1/jobs/{job}/report"
# The header carrying a member's credential (``RegisterResponse.credential``).
MEMBER_HEADER = "X-Bulkhead-Member"


def job_report_token(agents_token: str, job: str) -> str:
    """The token the workers of job ``job`` (its protocol name) present to node agents.

    An HMAC of the job under the agents' own token: the operator, which holds the agents'
    token, gives each job its own; an agent checks a report against the job in its path
    without storing anything per job; a job's token cannot speak for another job, and the
    agents' token itself never leaves the operator and the agents.
    """
    return hmac.new(agents_token.encode(), job.encode(), hashlib.sha256).hexdigest()


def replica_token(env: Mapping[str, str]) -> str | None:
    """The replica port's token in a launch environment ``env`` (see REPLICA_TOKEN_ENV)."""
    return env.get(REPLICA_TOKEN_ENV) or env.get(TOKEN_ENV) or None


class WorkerExit(IntEnum):
    """Exit codes of ``bulkhead-worker``, as the lifecycle manager reads them.

    Any other code, or death by a signal (OOMKilled, Evicted, a lost node), is an
    infrastructure failure: the worker is replaced.
    """

    DONE = 0  # the job is complete
    USER_ERROR = 2  # bad config or an exception in user code: the job fails, never retried
    STOPPED = 3  # told to stop by the manager


JobState = Literal["forming", "running", "restarting", "succeeded", "failed"]
FaultKind = Literal[
    "collective_error",  # a collective raised or timed out
    "peer_suspect",  # a peer stopped answering
    "nan_loss",  # the loss became NaN/inf
    "straggler",  # ranks persistently slower than the rest
    "user_error",  # an exception in user code or a bad config: not retried
    "internal_error",  # anything else in the runtime
    # A pod's launcher put its pre-started processes in place of its trainer processes (one
    # died or fell silent): the pod leaves the generation and joins again, not replaced.
    "processes_restarted",
]
Action = Literal["continue", "reconfigure", "stop"]


class RegisterRequest(Model):
    worker: str = Field(..., min_length=1, max_length=253, description="Unique worker id.")
    node: str = Field("", max_length=253, description="Node (host) the worker runs on.")
    address: str = Field("", max_length=300, description="host:port this worker can serve on.")
    checkpoint_address: str = Field(
        "",
        max_length=4096,
        description=(
            "host:port of this worker's checkpoint sidecar (replicas); one per trainer "
            "process, comma-separated in local-rank order, when the pod runs several."
        ),
    )
    incarnation: int = Field(0, ge=0, description="Restarts of this worker id so far.")
    claim: str | None = Field(
        None,
        min_length=16,
        max_length=128,
        description=(
            "A secret the registering process chose; a retry of the same registration "
            "(an answer lost on the way) presents it again to get the credential again."
        ),
    )


class RegisterResponse(Model):
    worker: str
    generation: int = Field(..., ge=0, description="The generation current at registration.")
    credential: str | None = Field(
        None, description=f"This member's credential, sent as {MEMBER_HEADER} from now on."
    )


class MembershipView(Membership):
    """A published generation plus what the workers must do with it."""

    state: JobState = "forming"
    resume_step: int = Field(0, ge=0, description="First step to run in this generation.")
    restore_from_checkpoint: bool = Field(
        False, description="No live replica holds the state: restore from a checkpoint."
    )
    total_steps: int = Field(0, ge=0)


DELTA_BASE_HEADER = "x-bulkhead-delta-base"


def membership_delta(base: MembershipView, view: MembershipView) -> dict[str, Any]:
    """``view`` as a change of ``base``: its fields, with ``members`` as segments.

    A segment is ``[start, stop]`` (base members start..stop-1, unchanged but for their
    rank) or a member object (new or changed). Ranks are positions: they are not sent.
    """
    index = {m.worker: i for i, m in enumerate(base.members)}
    segments: list[Any] = []
    for member in view.members:
        i = index.get(member.worker)
        same = i is not None and base.members[i].model_copy(update={"rank": member.rank}) == member
        if not same:
            segments.append(member.model_dump(mode="json", by_alias=True, exclude={"rank"}))
        elif segments and isinstance(segments[-1], list) and segments[-1][1] == i:
            segments[-1][1] = i + 1  # extends the run
        else:
            segments.append([i, i + 1])
    data = view.model_dump(mode="json", by_alias=True, exclude={"members"})
    data["members"] = segments
    return data


def apply_membership_delta(base: MembershipView, delta: dict[str, Any]) -> MembershipView:
    """The view ``membership_delta(base, view)`` describes; ValueError if it does not fit."""
    members: list[Member] = []
    for segment in delta.get("members", []):
        if isinstance(segment, list):
            start, stop = segment
            if not 0 <= start < stop <= len(base.members):
                raise ValueError(f"segment {segment} outside the base's {len(base.members)}")
            for kept in base.members[start:stop]:
                members.append(kept.model_copy(update={"rank": len(members)}))
        else:
            members.append(Member.model_validate({**segment, "rank": len(members)}))
    fields = {k: v for k, v in delta.items() if k != "members"}
    view = MembershipView.model_validate(fields)
    view.members = members
    return view


# The most steps one progress report carries besides its own: a worker whose manager has
# not answered for longer keeps the newest (a gap in the per-step figures, never in steps).
MAX_EARLIER_STEPS = 256


class StepFigures(Model):
    """One completed step's figures, carried by the next progress report sent."""

    step: int = Field(..., ge=0)
    loss: float | None = None
    step_time_s: float | None = Field(None, ge=0)
    tokens_per_s: float | None = Field(None, ge=0)
    val_loss: float | None = Field(
        None, description="Validation loss of the evaluation that followed this step, if one did."
    )
    age_s: float = Field(
        0.0,
        ge=0,
        description=(
            "Seconds from the step's completion to the report's sending, on the worker's "
            "clock: the manager dates the step by its own clock without clock sync."
        ),
    )


class ProgressReport(Model):
    """The newest completed step (its figures in the report's own fields) and, in
    ``earlier``, those of the steps completed since the worker's previous report.

    A worker sends at most one report per ``trainer.reportIntervalSeconds`` (the first of a
    generation, a changed plan and a step the manager asked for at once), so the cost of
    reporting does not grow with the step rate; every step's figures still arrive.
    """

    worker: str
    generation: int = Field(..., ge=0)
    step: int = Field(..., ge=0, description="Last completed step.")
    loss: float | None = None
    step_time_s: float | None = Field(None, ge=0)
    tokens_per_s: float | None = Field(None, ge=0)
    val_loss: float | None = Field(None, description="As in StepFigures, for ``step``.")
    age_s: float = Field(0.0, ge=0, description="As in StepFigures, for ``step``.")
    earlier: list[StepFigures] = Field(
        default_factory=list,
        max_length=MAX_EARLIER_STEPS,
        description="Steps completed since the previous report, oldest first.",
    )
    checkpoint_step: int | None = Field(None, ge=0)
    # From ranks that persist a checkpoint shard (the others send neither): the newest step
    # their sidecar wrote to storage, and its last persist error (None once one succeeds).
    persisted_step: int | None = Field(None, ge=0)
    persist_error: str | None = Field(None, max_length=1024)
    plan: list[Annotated[str, StringConstraints(max_length=512)]] | None = Field(
        None,
        max_length=64,
        description=(
            "Rank 0, when the parallel layout is new or changed (a new generation, an "
            "expert rebalance): the plan's lines, e.g. pipelines, experts per worker."
        ),
    )
    state_source: Literal["fresh", "kept", "peers", "checkpoint"] | None = Field(
        None,
        description=(
            "How this generation got its state: fresh start, "
            "every rank kept its own, moved between surviving holders, or restored from the "
            "checkpoint because some piece had no surviving holder."
        ),
    )
    setup: Literal["world", "state"] | None = Field(
        None,
        description=(
            "Set-up progress of the generation before its first step, and nothing else: "
            "its world formed ('world') or its state adopted ('state'); ``step`` is then "
            "the last step completed before (0 before any). The hang timer counts it as "
            "progress, so a slow set-up (a large world, a loaded machine, a big restore) "
            "is not taken for a hang; a set-up that stops advancing still is."
        ),
    )

    @model_validator(mode="after")
    def _earlier_precede(self) -> ProgressReport:
        steps = [f.step for f in self.earlier] + [self.step]
        if any(a >= b for a, b in itertools.pairwise(steps)):
            raise ValueError(f"earlier steps must ascend and precede step {self.step}")
        return self

    def figures(self) -> list[StepFigures]:
        """Every step this report carries, oldest first (the report's own step last)."""
        own = StepFigures(
            step=self.step,
            loss=self.loss,
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            val_loss=self.val_loss,
            age_s=self.age_s,
        )
        return [*self.earlier, own]


class FaultReport(Model):
    worker: str
    generation: int = Field(..., ge=0)
    kind: FaultKind
    message: str = Field("", max_length=4096)
    suspects: list[str] = Field(default_factory=list, description="Workers believed at fault.")
    step: int | None = Field(None, ge=0)


class CompletionReport(Model):
    worker: str
    generation: int = Field(..., ge=0)
    step: int = Field(..., ge=0)
    loss: float | None = None
    # As in ProgressReport, after the newest snapshot settled on storage.
    persisted_step: int | None = Field(None, ge=0)
    persist_error: str | None = Field(None, max_length=1024)


class Directive(Model):
    """The manager's answer to a report: keep going, move to a newer generation, or stop."""

    action: Action = "continue"
    generation: int = Field(..., ge=0, description="The current generation.")
    reason: str = ""
    report_step: int | None = Field(
        None,
        ge=0,
        description=(
            "Report the moment this step completes rather than at the report interval: "
            "the manager acts on it (a chaos fault of local mode is due at that step)."
        ),
    )


class WorkerReport(Model):
    """A worker's report to its node agent (``POST AGENT_REPORT_PATH`` on the agent, JSON)."""

    # A NaN or infinite loss is sent as such (NaN, Infinity): it is what the agent detects.
    model_config = ConfigDict(**Model.model_config, ser_json_inf_nan="constants")

    worker: str = Field(..., min_length=1, max_length=253)
    step: int = Field(..., ge=0, description="Last completed step.")
    loss: float | None = Field(None, description="May be NaN/inf: that is what we detect.")
    step_time_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    tokens_per_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    stragglers: list[str] = Field(
        default_factory=list, max_length=4096, description="Workers found persistently slow."
    )
    straggler_scores: dict[str, float] = Field(
        default_factory=dict, description="Worker -> score (reference median / own median)."
    )
    done: bool = Field(False, description="The worker finished: stop watching it.")
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="The job's hangTimeoutSeconds: silence is judged, and forgotten, by it.",
    )
