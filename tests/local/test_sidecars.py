"""Local checkpoint sidecars: the real bulkhead-checkpointd started and stopped per worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from bulkhead.operator.driver import WorkerRef
from bulkhead.operator.local.sidecars import SHM_DIR_ENV, SOCKET_ENV, CheckpointSidecars


@pytest.mark.slow
def test_sidecar_starts_before_its_worker_and_stops_after(tmp_path: Path) -> None:
    async def scenario() -> None:
        sidecars = CheckpointSidecars(tmp_path / "run", tmp_path / "shm", ready_timeout_s=60)
        ref = WorkerRef("job", 0, 0)
        env = await sidecars.start(ref)
        assert env[SHM_DIR_ENV] == str(tmp_path / "shm" / "job-w0-0")
        assert Path(env[SOCKET_ENV]).exists()
        (pid,) = [p.pid for p in sidecars._procs.values()]
        assert psutil.pid_exists(pid)
        await sidecars.stop(ref)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert not (tmp_path / "shm" / "job-w0-0").exists()
        assert (tmp_path / "run" / "logs" / "job-w0-0-checkpointd.log").exists()

    asyncio.run(scenario())
