"""A full shared-memory volume: the snapshot that does not fit fails cleanly (ENOSPC, not a
SIGBUS in the middle of a copy) and the previous snapshot stays restorable.

The volume is a real 1 MiB tmpfs mounted in a private mount namespace (``unshare -m``),
as a pod's ``emptyDir{medium: Memory, sizeLimit}`` would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from tests_paths import HERE

pytestmark = pytest.mark.slow


def test_a_snapshot_into_a_full_shared_memory_volume_fails_cleanly_and_keeps_the_last(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare(1) to mount a private tmpfs")
    shm_dir = tmp_path / f"shm-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {shm_dir} && "
        f"exec {sys.executable} -P {HERE / 'shm_full_child.py'} {shm_dir}"
    )
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{HERE.parent}"}
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["second"] == "refused", result
    # One line that says what happened and what to change.
    assert "No space left on device" in result["message"], result
    assert "sizeLimit" in result["message"], result
    assert result["restored_step"] == 10 and result["restored_intact"], result
