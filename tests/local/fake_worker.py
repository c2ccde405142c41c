"""A torch-free stand-in for ``bulkhead-worker`` that speaks the real control protocol.

Used where the test is about the supervisor, not about training (start-up failures,
Ctrl-C). FAKE_MODE: ``train`` (default: register, follow generations, report steps,
complete; also starts a grandchild ``sleep`` to check that stopping kills the whole group),
``user_error`` (exit 2 at once) or ``crash`` (exit 1 at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bulkhead.api.client import HttpControlClient
from bulkhead.api.protocol import (
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


if __name__ == "__main__":
    sys.exit(main())
