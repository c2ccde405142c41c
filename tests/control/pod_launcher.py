"""A pod launcher process as ``bulkhead-worker`` runs one (``worker._run_pod_launcher`` and
``worker.main``'s exit), its trainer processes the ``pod_child.py`` stand-ins: the tests
time how the process ends, which an in-process launcher cannot show."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from bulkhead.api.protocol import ENDPOINT_ENV, JOB_ENV, TOKEN_ENV, WORKER_ENV
from bulkhead.trainer.pod.launcher import PodLauncher
from bulkhead.trainer.pod.relay import PodRelay


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    env = os.environ
    processes = len(env["POD_CHILD_BEHAVIOURS"].split(","))
    relay = PodRelay(
        env[ENDPOINT_ENV], env[TOKEN_ENV], env[JOB_ENV], env[WORKER_ENV], processes, poll_s=2.0
    )
    child = [sys.executable, str(Path(__file__).with_name("pod_child.py"))]
    code = PodLauncher(env, relay, silence_limit_s=30.0, command=child).run()
    logging.shutdown()
    os._exit(code)  # as worker.main ends


if __name__ == "__main__":
    main()
