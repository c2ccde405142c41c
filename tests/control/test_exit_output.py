"""The test process ends with the summary: nothing a control server froze is reported as
leaked at exit (tests/exit_cleanup.py says why it would be)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent

# What the test process does: torch's compiler stack imported (by a first optimizer step),
# then a control server started in the same process.
SCRIPT = """
import sys
import torch, torch._dynamo
from bulkhead.operator.control import tune_gc_for_connections
tune_gc_for_connections()
if sys.argv[1] == "released":
    sys.path.insert(0, sys.argv[2])
    from exit_cleanup import release_frozen_objects
    release_frozen_objects()
"""


def _exit_output(mode: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-P", "-c", SCRIPT, mode, str(TESTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_frozen_objects_are_released_before_exit() -> None:
    frozen = _exit_output("frozen")
    # Why the release exists (if triton stops reporting, it can go).
    assert "nanobind: leaked" in frozen, "triton no longer reports frozen objects as leaked"
    assert "triton" in frozen
    assert _exit_output("released") == ""
