"""Checkpoint sidecars in local mode: one ``bulkhead-checkpointd`` per worker slot.

In Kubernetes the sidecar is a second container of the worker pod and its shared memory is
the node's; here a slot stands for a node: its sidecar and its shared-memory directory
(``<shm_root>/w<slot>``) are created with the slot's first worker and outlive each trainer
process, so a replacement trainer (a new incarnation) restores from its own shared memory
without touching storage. Everything is stopped (SIGTERM: the sidecar drains its export
first) and removed at the end of the run. Started by entry point, so the supervisor never
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

from bulkhead.api.protocol import CHECKPOINT_SOCKET_ENV, SHM_DIR_ENV, TOKEN_ENV
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local import children
from bulkhead.trainer.checkpoint.paths import default_socket, local_rank_shm_dir
from bulkhead.trainer.pod.prestart import die_with_parent

log = logging.getLogger(__name__)


def default_sidecar_command() -> list[str]:
    script = Path(sys.executable).with_name("bulkhead-checkpointd")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-P", "-m", "bulkhead.trainer.checkpoint.checkpointd"]


class CheckpointSidecars:
    """A ``SidecarLauncher`` for ``LocalDriver``."""

    def __init__(
        self,
        run_dir: Path,
        shm_root: Path,
        token: str | None = None,
        command: list[str] | None = None,
        ready_timeout_s: float = 60.0,
        drain_timeout_s: float = 30.0,
        local_ranks: int = 1,
    ) -> None:
        self.run_dir = run_dir
        self.shm_root = shm_root
        # Peers' replica requests must carry the job's control token, as in Kubernetes.
        self.token = token
        self.command = command or default_sidecar_command()
        self.ready_timeout_s = ready_timeout_s
        self.drain_timeout_s = drain_timeout_s
        # Trainer processes per worker: one sidecar process serves them all, one service
        # (slots, socket, replica port) each in its own directory.
        self.local_ranks = local_ranks
        self._procs: dict[int, asyncio.subprocess.Process] = {}

    def shm_dir(self, slot: int) -> Path:
        return self.shm_root / f"w{slot}"

    async def start(self, worker: WorkerRef) -> dict[str, str]:
        """The slot's sidecar (started now unless it still runs) and the worker's env."""
        shm_dir = self.shm_dir(worker.slot)
        running = self._procs.get(worker.slot)
        if running is None or running.returncode is not None:
            await self._spawn(worker, shm_dir)
        if self.local_ranks > 1:  # the launcher gives each process its rank's directory
            return {SHM_DIR_ENV: str(shm_dir)}
        return {SHM_DIR_ENV: str(shm_dir), CHECKPOINT_SOCKET_ENV: str(default_socket(shm_dir))}

    def _sockets(self, shm_dir: Path) -> list[Path]:
        if self.local_ranks == 1:
            return [default_socket(shm_dir)]
        return [default_socket(local_rank_shm_dir(shm_dir, i)) for i in range(self.local_ranks)]

    async def _spawn(self, worker: WorkerRef, shm_dir: Path) -> None:
        shm_dir.mkdir(parents=True, exist_ok=True)
        sockets = self._sockets(shm_dir)
        for socket_path in sockets:
            socket_path.unlink(missing_ok=True)
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{worker.job}-w{worker.slot}-checkpointd.log"
        with log_path.open("ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                "--shm-dir",
                str(shm_dir),
                "--local-ranks",
                str(self.local_ranks),
                "--listen",
                "127.0.0.1:0",
                env={**os.environ, TOKEN_ENV: self.token} if self.token else None,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                # A supervisor killed outright (SIGKILL, a timeout) runs no clean-up: the
                # sidecar must not outlive it holding its shared memory.
                preexec_fn=die_with_parent,
            )
        self._procs[worker.slot] = process
        children.track(process.pid)  # its session's group ends with this process
        deadline = time.monotonic() + self.ready_timeout_s
        while not all(socket_path.exists() for socket_path in sockets):
            if process.returncode is not None:
                raise RuntimeError(
                    f"checkpoint sidecar of slot {worker.slot} exited with code "
                    f"{process.returncode}"
                )
            if time.monotonic() > deadline:
                await self._stop(worker.slot)
                raise TimeoutError(f"checkpoint sidecar of slot {worker.slot} not ready")
            await asyncio.sleep(0.05)
        log.info("checkpoint sidecar of slot %d ready (pid %d)", worker.slot, process.pid)

    async def stop(self, worker: WorkerRef) -> None:
        """A trainer exited: its sidecar and snapshots stay for the slot's next trainer."""

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(slot) for slot in list(self._procs)))
        shutil.rmtree(self.shm_root, ignore_errors=True)

    async def _stop(self, slot: int) -> None:
        process = self._procs.pop(slot, None)
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.drain_timeout_s)
            except TimeoutError:
                log.warning("checkpoint sidecar of slot %d did not drain; killing it", slot)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        children.untrack(process.pid)
        await process.wait()
        shutil.rmtree(self.shm_dir(slot), ignore_errors=True)
