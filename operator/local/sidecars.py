"""Checkpoint sidecars in local mode: one ``bulkhead-checkpointd`` next to each worker.

In Kubernetes the sidecar is a second container of the worker pod; here it is a process
started before its worker and stopped (SIGTERM: it drains its export first) after the
worker exits, like a pod going away. Started by entry point, so the supervisor never
imports the trainer (nor torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from bulkhead.operator.driver import WorkerRef

log = logging.getLogger(__name__)

SHM_DIR_ENV = "BULKHEAD_SHM_DIR"
SOCKET_ENV = "BULKHEAD_CHECKPOINT_SOCKET"


def default_sidecar_command() -> list[str]:
    script = Path(sys.executable).with_name("bulkhead-checkpointd")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "bulkhead.trainer.checkpoint.sidecar"]


class CheckpointSidecars:
    """A ``SidecarLauncher`` for ``LocalDriver``."""

    def __init__(
        self,
        run_dir: Path,
        shm_root: Path,
        command: list[str] | None = None,
        ready_timeout_s: float = 60.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.run_dir = run_dir
        self.shm_root = shm_root
        self.command = command or default_sidecar_command()
        self.ready_timeout_s = ready_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, worker: WorkerRef) -> dict[str, str]:
        shm_dir = self.shm_root / worker.id
        shm_dir.mkdir(parents=True, exist_ok=True)
        socket_path = shm_dir / "checkpointd.sock"
        socket_path.unlink(missing_ok=True)
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{worker.id}-checkpointd.log").open("ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                "--shm-dir",
                str(shm_dir),
                "--socket",
                str(socket_path),
                "--listen",
                "127.0.0.1:0",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs[worker.id] = process
        deadline = time.monotonic() + self.ready_timeout_s
        while not socket_path.exists():
            if process.returncode is not None:
                raise RuntimeError(
                    f"checkpoint sidecar of {worker.id} exited with code {process.returncode}"
                )
            if time.monotonic() > deadline:
                await self.stop(worker)
                raise TimeoutError(f"checkpoint sidecar of {worker.id} not ready")
            await asyncio.sleep(0.05)
        log.info("checkpoint sidecar of %s ready (pid %d)", worker.id, process.pid)
        return {SHM_DIR_ENV: str(shm_dir), SOCKET_ENV: str(socket_path)}

    async def stop(self, worker: WorkerRef) -> None:
        await self._stop(worker.id)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(worker_id) for worker_id in list(self._procs)))
        with contextlib.suppress(OSError):
            self.shm_root.rmdir()  # only when empty

    async def _stop(self, worker_id: str) -> None:
        process = self._procs.pop(worker_id, None)
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.drain_timeout_s)
            except TimeoutError:
                log.warning("checkpoint sidecar of %s did not drain; killing it", worker_id)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        shutil.rmtree(self.shm_root / worker_id, ignore_errors=True)
