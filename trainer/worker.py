"""``bulkhead-worker``: one elastic training worker, configured by the launch environment.

Reads the worker launch contract (BULKHEAD_CONTROL_URL, BULKHEAD_CONTROL_TOKEN,
BULKHEAD_JOB, BULKHEAD_WORKER, BULKHEAD_INCARNATION, BULKHEAD_NODE,
BULKHEAD_ADVERTISE_HOST, BULKHEAD_JOB_SPEC, optional BULKHEAD_RUN_DIR, BULKHEAD_SHM_DIR,
BULKHEAD_AGENT_URL and BULKHEAD_AGENT_TOKEN), runs the
``ElasticTrainer`` and maps the outcome to the exit codes the lifecycle manager reads:
0 finished, 2 user error (never retried), 3 told to stop, anything else = replace me.
When the job runs several trainer processes per pod, or in a Kubernetes pod
(BULKHEAD_POD_LAUNCHER), the first ``bulkhead-worker`` of the pod is their launcher
(``trainer.pod``) and each process it starts has BULKHEAD_LOCAL_RANK.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from bulkhead.api.manifest import ManifestError, parse_spec
from bulkhead.api.protocol import (
    ADVERTISE_HOST_ENV,
    CHECKPOINT_SOCKET_ENV,
    ENDPOINT_ENV,
    INCARNATION_ENV,
    JOB_ENV,
    JOB_SPEC_ENV,
    LOCAL_RANK_ENV,
    NODE_ENV,
    POD_LAUNCHER_ENV,
    RUN_DIR_ENV,
    SHM_DIR_ENV,
    TOKEN_ENV,
    WORKER_ENV,
    FaultReport,
    WorkerExit,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import Timeouts, TrainConfig, train_config
from bulkhead.trainer.pod.prestart import serve_forks
from bulkhead.trainer.runtime.control_client import ControlChannel

if TYPE_CHECKING:
    from bulkhead.trainer.runtime.loop import Checkpointer, ElasticTrainer

# Any code outside WorkerExit means "infrastructure failure: replace me".
EXIT_INFRASTRUCTURE = 1
LOG_LEVEL_ENV = "BULKHEAD_LOG_LEVEL"

log = logging.getLogger("bulkhead.trainer.worker")


class LaunchError(ValueError):
    """The launch environment is incomplete or malformed (a user / deployment error)."""


@dataclass(frozen=True)
class LaunchEnv:
    control_url: str
    token: str
    job: str
    worker: str
    incarnation: int
    node: str
    advertise_host: str
    spec_json: str
    run_dir: Path | None
    local_rank: int | None = None  # set on the processes of a multi-process pod


def read_env(env: Mapping[str, str]) -> LaunchEnv:
    required = [ENDPOINT_ENV, TOKEN_ENV, JOB_ENV, WORKER_ENV, JOB_SPEC_ENV]
    missing = [name for name in required if not env.get(name)]
    if missing:
        raise LaunchError(f"missing environment variables: {', '.join(missing)}")
    try:
        incarnation = int(env.get(INCARNATION_ENV, "0"))
    except ValueError:
        raise LaunchError(f"{INCARNATION_ENV} must be an integer") from None
    run_dir = env.get(RUN_DIR_ENV)
    local_rank = None
    if env.get(LOCAL_RANK_ENV):
        try:
            local_rank = int(env[LOCAL_RANK_ENV])
        except ValueError:
            raise LaunchError(f"{LOCAL_RANK_ENV} must be an integer") from None
    return LaunchEnv(
        control_url=env[ENDPOINT_ENV],
        token=env[TOKEN_ENV],
        job=env[JOB_ENV],
        worker=env[WORKER_ENV],
        incarnation=incarnation,
        node=env.get(NODE_ENV, ""),
        advertise_host=env.get(ADVERTISE_HOST_ENV, "127.0.0.1"),
        spec_json=env[JOB_SPEC_ENV],
        run_dir=Path(run_dir) if run_dir else None,
        local_rank=local_rank,
    )


def _setup_logging(worker: str) -> None:
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{worker}] %(name)s: %(message)s",
    )
    # One line per control request would cost more than the step it reports on.
    if level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)


def run(env: Mapping[str, str], started_at: float | None = None) -> int:
    """Run one worker to its end; returns the process exit code. ``started_at``: when this
    process was given its launch environment (``time.monotonic``), where its first
    generation's timeline starts."""
    launch = _read_launch(env)
    if launch is None:
        return WorkerExit.USER_ERROR
    from bulkhead.api.client import ControlError, HttpControlClient, MemberCredential

    member = MemberCredential()  # registration fills it in for every client of this process

    def connect(retries: int = 5) -> ControlChannel:
        return HttpControlClient(
            launch.control_url,
            launch.token,
            launch.job,
            launch.worker,
            retries=retries,
            member=member,
        )

    def user_error(exc: Exception, generation: int = 0, trace: bool = False) -> int:
        log.error("user error: %s", exc, exc_info=trace)
        _report_user_error(connect(retries=1), launch.worker, generation, str(exc))
        return WorkerExit.USER_ERROR

    # The spec is checked before torch is imported: a bad job fails in well under a second.
    try:
        spec = parse_spec(json.loads(launch.spec_json), source=JOB_SPEC_ENV)
        cfg = train_config(spec)
    except (ManifestError, ValueError) as exc:
        return user_error(exc)
    processes = spec.trainer_processes
    if is_pod_launcher(launch, processes, env):
        return _run_pod_launcher(launch, env, processes, cfg.timeouts)
    if launch.local_rank is not None and not 0 <= launch.local_rank < processes:
        return user_error(
            LaunchError(f"{LOCAL_RANK_ENV}={launch.local_rank}, but the pod runs {processes}")
        )

    import torch

    from bulkhead.trainer.data import DataError
    from bulkhead.trainer.runtime.loop import NoGeneration, Stopped

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    trainer: ElasticTrainer | None = None
    try:
        trainer = _build_trainer(launch, env, spec, cfg, connect, started_at)
        trainer.run()
        return WorkerExit.DONE
    except DataError as exc:
        return user_error(exc)
    except (ValueError, TypeError) as exc:
        if raised_inside(exc, _package_dir(torch)):
            # Not the user's settings or code failing a check: torch itself, on whatever
            # this machine did to it. Replaced (and bounded by maxRestarts), not failed.
            log.exception("error inside torch; exiting for a replacement")
            return EXIT_INFRASTRUCTURE
        generation = trainer.watcher.generation if trainer is not None else 0
        return user_error(exc, generation, trace=True)
    except Stopped as exc:
        log.info("stopping: %s", exc)
        return WorkerExit.DONE if exc.job_succeeded else WorkerExit.STOPPED
    except (NoGeneration, ControlError) as exc:
        log.error("giving up: %s", exc)
        return EXIT_INFRASTRUCTURE
    except KeyboardInterrupt:
        log.info("interrupted")
        return 128 + signal.SIGINT


def is_pod_launcher(launch: LaunchEnv, processes: int, env: Mapping[str, str]) -> bool:
    """Whether this process is its pod's launcher: the first process of a pod of several
    trainer processes, or of a Kubernetes pod (``POD_LAUNCHER_ENV``) of one."""
    return launch.local_rank is None and (processes > 1 or env.get(POD_LAUNCHER_ENV) == "1")


def _read_launch(env: Mapping[str, str]) -> LaunchEnv | None:
    """The launch environment, with logging set up for this worker; None if it is bad."""
    try:
        launch = read_env(env)
    except LaunchError as exc:
        logging.basicConfig(level=logging.INFO)
        log.error("bad launch environment: %s", exc)
        return None
    _setup_logging(
        launch.worker if launch.local_rank is None else f"{launch.worker}/{launch.local_rank}"
    )
    return launch


def _build_trainer(
    launch: LaunchEnv,
    env: Mapping[str, str],
    spec: TrainingJobSpec,
    cfg: TrainConfig,
    connect: Callable[[], ControlChannel],
    started_at: float | None = None,
) -> ElasticTrainer:
    """The elastic trainer of this process: its datasets, identity, checkpointer, reporters."""
    from bulkhead.trainer.data import open_datasets
    from bulkhead.trainer.runtime.loop import ElasticTrainer, WorkerIdentity
    from bulkhead.trainer.runtime.node_agent import NodeAgentReporter
    from bulkhead.trainer.runtime.samples_log import SamplesLog

    datasets = open_datasets(cfg)
    samples = None
    if launch.run_dir is not None:
        samples = SamplesLog(launch.run_dir / "samples.jsonl", cfg.global_batch_size)
    identity = WorkerIdentity(
        launch.worker,
        launch.node,
        launch.incarnation,
        launch.advertise_host,
        local_rank=launch.local_rank or 0,
    )
    return ElasticTrainer(
        cfg,
        connect,
        identity,
        datasets.train,
        samples_log=samples,
        checkpointer=_checkpointer(env, spec, launch),
        node_agent=NodeAgentReporter.from_env(env),
        eval_dataset=datasets.eval,
        started_at=started_at,
    )


def _package_dir(module: object) -> Path:
    return Path(getattr(module, "__file__", "")).resolve().parent


def raised_inside(exc: BaseException, package: Path) -> bool:
    """Whether ``exc`` was raised by code under ``package`` (the frame it came from, the
    innermost of its traceback): a ValueError from our config checks, a model's size
    checks or user code is a user error; one from deep inside torch is not, by itself."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(package)


def _run_pod_launcher(
    launch: LaunchEnv, env: Mapping[str, str], processes: int, timeouts: Timeouts
) -> int:
    """This process is the pod's launcher: ``processes`` trainer processes behind a relay."""
    from bulkhead.trainer.pod.launcher import run_pod
    from bulkhead.trainer.pod.relay import PodRelay

    log.info(
        "launching %d trainer processes for %s (launcher pid %d)",
        processes,
        launch.worker,
        os.getpid(),
    )
    relay = PodRelay(
        launch.control_url,
        launch.token,
        launch.job,
        launch.worker,
        processes,
        poll_s=timeouts.membership_poll_s,
    )
    # Silent for half the hang timeout: what the manager's own silence rule waits for.
    return run_pod(env, relay, silence_limit_s=timeouts.hang_s / 2)


def _report_user_error(client: ControlChannel, worker: str, generation: int, message: str) -> None:
    """Best effort: the manager fails the job at once instead of waiting for the exit."""
    try:
        client.fault(
            FaultReport(worker=worker, generation=generation, kind="user_error", message=message)
        )
    except Exception as exc:
        log.debug("could not report the user error: %s", exc)


def _checkpointer(
    env: Mapping[str, str], spec: TrainingJobSpec, launch: LaunchEnv
) -> Checkpointer | None:
    """The checkpoint engine when a sidecar runs next to this worker (its env is set)."""
    if not (env.get(SHM_DIR_ENV) or env.get(CHECKPOINT_SOCKET_ENV)):
        log.info("no checkpoint sidecar (%s unset): snapshots off", SHM_DIR_ENV)
        return None
    from bulkhead.trainer.checkpoint.trainer_side import CheckpointEngine, CheckpointSettings
    from bulkhead.trainer.runtime.checkpointing import EngineCheckpointer

    settings = CheckpointSettings.from_spec(
        spec.checkpoint, job=launch.job, env=env, worker=launch.worker
    )
    return EngineCheckpointer(CheckpointEngine(settings), model=spec.trainer.model.wire())


def main() -> None:
    # SIGTERM (the manager stopping this worker, a pod deletion) ends the process at once;
    # the state that matters lives in the surviving replicas and the checkpoint sidecar.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(WorkerExit.STOPPED))
    _finish(run(os.environ, started_at=time.monotonic()))


def template_main() -> None:
    """The template of pre-started workers (``trainer.pod.prestart``): torch and the trainer
    imported once (the seconds of a cold start), then a process forked per request runs as
    ``main`` would have, with the request's launch environment. End of input: exit 3 (the
    supervisor no longer needs it)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(WorkerExit.STOPPED))
    # numpy's BLAS would start its thread pool at import: a fork copies no thread.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    serve_forks(_import_trainer, _become)


def _import_trainer() -> None:
    import torch  # noqa: F401

    from bulkhead.trainer.engine.engine import import_lazy_dependencies
    from bulkhead.trainer.runtime import loop  # noqa: F401

    import_lazy_dependencies()
    from bulkhead.api.client import tls_context

    tls_context()  # its control clients' (the CA bundle's load), made before it is needed


def _become(env: dict[str, str], handed_over: float) -> NoReturn:
    """A process forked from the template: the worker ``env`` describes."""
    os.environ.clear()
    os.environ.update(env)
    _finish(run(os.environ, started_at=handed_over))


def _finish(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: the interpreter's teardown would wait for gloo groups parked after a failure.
    os._exit(code)


if __name__ == "__main__":
    main()
