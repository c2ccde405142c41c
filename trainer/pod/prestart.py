"""Pre-started trainer processes: the one way a process is started before it is needed.

A pre-started process (``bulkhead.trainer.worker.prestarted_main``) imports torch and the
trainer first (the seconds of a cold start), then waits for its launch environment as one
JSON line on stdin and becomes the trainer that environment names; end of input without
one makes it exit 3. Local mode's driver keeps a pool of them for its worker "pods", and a
multi-process pod's launcher keeps one per local rank for the trainer processes it runs:
both start them with ``prestarted_command`` and hand one over with ``handover_line``.
Their imports take seconds of CPU that a start or a recovery needs: where the starter can
give a process its priority back (``can_renice_back``), it starts them at a lower one.
No torch here: the operator's local driver imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Mapping

# Carried in the hand-over line beside the environment, never into it: when (wall clock,
# the starter's and the process's, on one machine) the process was handed over. A process
# handed over before its imports were done counts its start from then, not from its
# imports' end.
HANDED_OVER_AT = "BULKHEAD_HANDED_OVER_AT"


def prestarted_command() -> list[str]:
    """A trainer process that imports first and waits for its launch environment on stdin."""
    return [sys.executable, "-P", "-c", "from bulkhead.trainer.worker import prestarted_main; "
            "prestarted_main()"]  # fmt: skip


def handover_line(env: Mapping[str, str]) -> bytes:
    """What a pre-started process reads to become the trainer ``env`` describes (with the
    moment it was handed over, ``HANDED_OVER_AT``)."""
    return json.dumps({**env, HANDED_OVER_AT: repr(time.time())}).encode() + b"\n"


def hand_over(process: subprocess.Popen[bytes], env: Mapping[str, str]) -> bool:
    """Give a waiting ``process`` (started with ``stdin=PIPE``) its launch environment;
    False when it is no longer waiting (it died)."""
    if process.poll() is not None or process.stdin is None:
        return False
    try:
        process.stdin.write(handover_line(env))
        process.stdin.flush()
    except (BrokenPipeError, ConnectionResetError, ValueError):
        return False
    finally:
        with contextlib.suppress(OSError):
            process.stdin.close()
    return True


def can_renice_back() -> bool:
    """Whether this process may give a child whose priority it lowered its own back
    (setpriority(2): root, or RLIMIT_NICE allowing this process's nice value)."""
    if os.geteuid() == 0:
        return True
    allowed = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return allowed == resource.RLIM_INFINITY or 20 - allowed <= os.getpriority(os.PRIO_PROCESS, 0)
