"""Every bench ended by SIGTERM mid-run leaves no process of its own behind (issue 39).

Each bench starts in a session of its own, runs until it has started a child process (or
finished, for one that starts none), gets SIGTERM (the pid only, as a timeout sends it),
and must exit with every process it started gone: none left in its process group and
none of its descendants seen before the signal still alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bulkhead.operator.local.children import family

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Scripts that benches start (not benches themselves) and private helpers.
NOT_BENCHES = {"ddp_baseline"}
BENCHES = sorted(
    p.stem for p in (REPO / "bench").glob("*.py")
    if not p.stem.startswith("_") and p.stem not in NOT_BENCHES
)  # fmt: skip
START_TIMEOUT_S = 240.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


@pytest.mark.timeout(600)  # a bench's start under a heavy load takes minutes
@pytest.mark.parametrize("bench", BENCHES)
def test_sigterm_leaves_nothing(bench: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-P", str(REPO / "bench" / f"{bench}.py"), "--quick",
         "--out", str(tmp_path / "out.json")],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None and not seen:
            assert time.monotonic() < deadline, f"{bench} started no process in time"
            seen |= set(family(proc.pid))
            time.sleep(0.2)
        time.sleep(1.0)  # let it start more (a trainer's own children)
        seen |= set(family(proc.pid))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        left = [pid for pid in seen | set(family(proc.pid)) if _alive(pid)]
        assert not left, f"{bench} left {left} running after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in seen:  # whatever a failing bench left: never let the test leak it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
