"""A checkpoint sidecar as a child process, for the checkpoint tests (synchronous).

The product's only spawner is local mode's ``bulkhead.operator.local.sidecars`` (in
Kubernetes the sidecar is a container); this one exists so tests can start a sidecar with
any flags, kill it mid-persist and restart it, without a supervisor.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from bulkhead.trainer.checkpoint.client import SidecarClient, SidecarUnavailable
from bulkhead.trainer.checkpoint.paths import default_socket

log = logging.getLogger(__name__)

READY_POLL_SECONDS = 0.05


class SidecarProcess:
    """A running ``bulkhead-checkpointd`` child process."""

    def __init__(self, process: subprocess.Popen[bytes], shm_dir: Path, socket_path: Path) -> None:
        self.process = process
        self.shm_dir = shm_dir
        self.socket_path = socket_path
        self.client = SidecarClient(socket_path)
        self.replica_address: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"checkpoint sidecar exited ({code}) before it was ready")
            try:
                self.replica_address = self.client.status().get("replica_address")
                return
            except SidecarUnavailable:
                if time.monotonic() >= deadline:
                    self.kill()
                    raise TimeoutError(f"checkpoint sidecar not ready within {timeout}s") from None
                time.sleep(READY_POLL_SECONDS)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the sidecar drains its export), then SIGKILL after ``timeout``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("checkpoint sidecar %d ignored SIGTERM; killing it", self.pid)
        return self.kill()

    def kill(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()


def spawn_sidecar(
    shm_dir: Path,
    socket_path: Path | None = None,
    listen: str = "off",
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_file: IO[Any] | None = None,
    ready_timeout: float = 60.0,
) -> SidecarProcess:
    """Start a sidecar for ``shm_dir`` and return once its socket answers.

    ``listen`` is the replica TCP address ("off" disables it; port 0 picks a free port,
    readable afterwards as ``replica_address``). ``args`` are extra command-line flags,
    e.g. ``["--max-write-mbps", "200"]``.
    """
    shm_dir = Path(shm_dir)
    socket_path = Path(socket_path) if socket_path else default_socket(shm_dir)
    command = [
        sys.executable,
        "-P",  # never import from the working directory (a checkout's operator/ shadows stdlib)
        "-m",
        "bulkhead.trainer.checkpoint.checkpointd",
        "--shm-dir",
        str(shm_dir),
        "--socket",
        str(socket_path),
        "--listen",
        listen,
        *(args or []),
    ]
    process = subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=log_file or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the driver must not kill it mid-persist
    )
    sidecar = SidecarProcess(process, shm_dir, socket_path)
    sidecar.wait_ready(ready_timeout)
    log.info("checkpoint sidecar %d ready (replicas on %s)", sidecar.pid, sidecar.replica_address)
    return sidecar
