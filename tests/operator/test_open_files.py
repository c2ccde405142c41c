"""A control-plane process raises its soft open-file limit to the hard one before its loop
starts, and logs the figure (issue 36: at 1,024 a job of ~1,000 pods ran out of sockets)."""

from __future__ import annotations

import resource
import subprocess
import sys

CHILD = """
import asyncio, logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from bulkhead.operator.control import run_event_loop

async def limits():
    await asyncio.sleep(0)
    return resource.getrlimit(resource.RLIMIT_NOFILE)

print("inside", *run_event_loop(limits()))
"""


def _low_soft_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


def test_the_loop_runs_with_the_hard_open_file_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > 256, "the test needs a hard limit above its lowered soft one"
    child = subprocess.run(
        [sys.executable, "-P", "-c", CHILD],
        preexec_fn=_low_soft_limit,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = child.stdout.splitlines()
    expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert f"inside {expected} {hard}" in lines, child.stdout + child.stderr
    assert f"open files: limit {expected} (was 256, hard limit {hard})" in lines, child.stdout
