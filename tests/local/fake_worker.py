"""A torch-free stand-in for ``bulkhead-worker`` that speaks the real control protocol.

Used where the test is about the supervisor, not about training (start-up failures,
Ctrl-C). FAKE_MODE: ``train`` (default: register, follow generations, report steps,
complete; also starts a grandchild ``sleep`` to check that stopping kills the whole group),
``user_error`` (exit 2 at once) or ``crash`` (exit 1 at once). In ``train`` mode:
FAKE_FORGE=1 makes the worker of slot 0 first report, with its own credential, the last
step and the completion of every other member (the manager must refuse them: one line
``forged <route> for <worker>: HTTP <status>`` each on stderr); FAKE_WEDGE_AT_STEP=N
wedges the training loop of every first incarnation at step N while a thread keeps
long-polling membership (a training thread stuck, the poll thread alive).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from bulkhead.api.client import ControlRequestError, HttpControlClient
from bulkhead.api.protocol import (
    INCARNATION_ENV,
    WORKER_ENV,
    CompletionReport,
    ProgressReport,
    RegisterRequest,
    WorkerExit,
)


def main() -> int:
    mode = os.environ.get("FAKE_MODE", "train")
    if mode == "user_error":
        print("bad config: lr must be positive", file=sys.stderr)
        return WorkerExit.USER_ERROR
    if mode == "crash":
        return 1
    signal.signal(signal.SIGTERM, lambda *_: os._exit(WorkerExit.STOPPED))
    subprocess.Popen(["sleep", "600"])  # a grandchild: must die with its worker
    step_s = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
    # Like the trainer: tokens of the global batch over this worker's own step time.
    step_tokens = float(os.environ.get("FAKE_TOKENS_PER_STEP", "768"))
    me = os.environ[WORKER_ENV]
    client = HttpControlClient.from_env()
    client.register(RegisterRequest(worker=me, address=f"{me}.fake:1"))
    if os.environ.get("FAKE_FORGE") and "-w0-" in me:
        _forge(client, me)
    wedge_at = int(os.environ.get("FAKE_WEDGE_AT_STEP", "-1"))
    if os.environ.get(INCARNATION_ENV, "0") != "0":
        wedge_at = -1
    generation, step = 0, 0
    while True:
        view = client.membership(after=generation, timeout_s=5)
        if view.state in ("succeeded", "failed"):
            return WorkerExit.STOPPED
        if view.generation <= generation or me not in [m.worker for m in view.members]:
            continue
        generation = view.generation
        step = max(step, view.resume_step)
        while step < view.total_steps:
            if step == wedge_at:
                _wedge(client, generation)
            began = time.monotonic()
            time.sleep(step_s)
            took = time.monotonic() - began
            report = ProgressReport(
                worker=me,
                generation=generation,
                step=step,
                loss=5.0 / (step + 1),
                step_time_s=took,
                tokens_per_s=step_tokens / took,
            )
            directive = client.progress(report)
            step += 1
            if directive.action == "stop":
                return WorkerExit.STOPPED
            if directive.action == "reconfigure":
                break
        else:
            client.complete(CompletionReport(worker=me, generation=generation, step=step - 1))
            return WorkerExit.DONE


def _forge(client: HttpControlClient, me: str) -> None:
    """Reports in the other members' names, with this worker's own credential."""
    view = client.membership(after=0, timeout_s=30)
    while view.generation == 0:
        view = client.membership(after=0, timeout_s=30)
    last = view.total_steps - 1
    for other in (m.worker for m in view.members if m.worker != me):
        for route, send in (
            (
                "progress",
                lambda w: client.progress(ProgressReport(worker=w, generation=1, step=last)),
            ),
            (
                "complete",
                lambda w: client.complete(CompletionReport(worker=w, generation=1, step=last)),
            ),
        ):
            try:
                send(other)
                status = 200
            except ControlRequestError as exc:
                status = exc.status_code
            print(f"forged {route} for {other}: HTTP {status}", file=sys.stderr, flush=True)


def _wedge(client: HttpControlClient, generation: int) -> None:
    """The training loop stops for good; a membership poller (its own client, sharing the
    credential, as the trainer's watcher) keeps this worker alive to the manager."""
    poller = HttpControlClient.from_env(member=client.member)

    def poll() -> None:
        after = generation
        while True:
            after = poller.membership(after=after, timeout_s=5).generation

    threading.Thread(target=poll, daemon=True).start()
    print(f"training thread wedged at generation {generation}", file=sys.stderr, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
