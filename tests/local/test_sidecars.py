"""Local checkpoint sidecars: the real bulkhead-checkpointd, one per worker slot."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from waiting import wait_until

from bulkhead.api.protocol import CHECKPOINT_SOCKET_ENV, SHM_DIR_ENV
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local.sidecars import CheckpointSidecars
from bulkhead.trainer.checkpoint.client import SidecarClient
from bulkhead.trainer.checkpoint.replica import ReplicaError, list_replicas

TOKEN = "local-job-token"


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


@pytest.mark.slow
def test_sidecar_outlives_its_trainer_and_is_removed_at_the_end(tmp_path: Path) -> None:
    async def scenario() -> None:
        sidecars = CheckpointSidecars(
            tmp_path / "run", tmp_path / "shm", token=TOKEN, ready_timeout_s=60
        )
        first = WorkerRef("job", 0, 0)
        env = await sidecars.start(first)
        assert env[SHM_DIR_ENV] == str(tmp_path / "shm" / "w0")
        assert Path(env[CHECKPOINT_SOCKET_ENV]).exists()
        # Its replica server takes the job's token, as in a pod: a stranger gets nothing.
        address = SidecarClient(Path(env[CHECKPOINT_SOCKET_ENV])).status()["replica_address"]
        assert list_replicas(address, "job", TOKEN, timeout=10) == []
        with pytest.raises(ReplicaError):
            list_replicas(address, "job", "wrong-token", timeout=10)
        (pid,) = [p.pid for p in sidecars._procs.values()]
        assert psutil.pid_exists(pid)
        # The trainer died: its snapshots stay in shared memory for the next incarnation.
        await sidecars.stop(first)
        assert psutil.pid_exists(pid) and (tmp_path / "shm" / "w0").is_dir()
        assert await sidecars.start(WorkerRef("job", 0, 1)) == env
        assert [p.pid for p in sidecars._procs.values()] == [pid]
        await sidecars.stop_all()
        assert _gone(pid)
        assert not (tmp_path / "shm").exists()
        assert (tmp_path / "run" / "logs" / "job-w0-checkpointd.log").exists()

    asyncio.run(scenario())


SUPERVISOR = """
import asyncio, sys
from pathlib import Path
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local.sidecars import CheckpointSidecars

async def main():
    tmp = Path(sys.argv[1])
    sidecars = CheckpointSidecars(tmp / "run", tmp / "shm", token="t", ready_timeout_s=60)
    await sidecars.start(WorkerRef("job", 0, 0))
    print(*[p.pid for p in sidecars._procs.values()], flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_supervisor_killed_outright_leaves_no_sidecar(tmp_path: Path) -> None:
    """SIGKILL (or a timeout) gives the supervisor no chance to stop its sidecars: each
    dies with it (parent-death signal) instead of holding its shared memory for ever."""
    supervisor = subprocess.Popen(
        [sys.executable, "-P", "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert supervisor.stdout is not None
        (pid,) = map(int, supervisor.stdout.readline().split())
        assert psutil.pid_exists(pid) and not _gone(pid)
    finally:
        supervisor.kill()
        supervisor.wait(timeout=30)
    wait_until(lambda: _gone(pid), "the sidecar to die with its supervisor", timeout=10)
