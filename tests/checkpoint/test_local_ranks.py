"""One sidecar process for a pod of several trainer processes: a service per process.

``bulkhead-checkpointd --local-ranks 2`` serves two slot directories, two sockets and two
replica ports (the listen port + local rank), as a worker pod of two GPUs needs: each
trainer process snapshots into its own slots and its replicas travel on its own port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

from bulkhead.api.protocol import TOKEN_ENV
from bulkhead.trainer.checkpoint.client import SidecarClient
from bulkhead.trainer.checkpoint.paths import default_socket, local_rank_shm_dir

CHECKPOINTD = [sys.executable, "-P", "-m", "bulkhead.trainer.checkpoint.checkpointd"]


def _free_port_pair() -> int:
    """A port p with p + 1 free too (checked, then released for the sidecar)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def test_a_sidecar_serves_each_local_rank_on_its_own_socket_and_port(tmp_path: Path) -> None:
    port = _free_port_pair()
    proc = subprocess.Popen(
        [*CHECKPOINTD, "--shm-dir", str(tmp_path), "--local-ranks", "2",
         "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, TOKEN_ENV: "job-token"},  # replica ports serve only with one
    )  # fmt: skip
    try:
        sockets = [default_socket(local_rank_shm_dir(tmp_path, i)) for i in range(2)]
        wait_until(lambda: all(s.exists() for s in sockets), "both sockets", timeout=30)
        addresses = [SidecarClient(s).status()["replica_address"] for s in sockets]
        assert addresses == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0


def test_one_socket_for_several_ranks_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CHECKPOINTD, "--shm-dir", str(tmp_path), "--local-ranks", "2",
         "--socket", str(tmp_path / "s.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "each is in its rank dir" in proc.stderr


@pytest.mark.parametrize("ranks", ["0", "-1"])
def test_local_ranks_must_be_positive(tmp_path: Path, ranks: str) -> None:
    proc = subprocess.run(
        [*CHECKPOINTD, "--shm-dir", str(tmp_path), "--local-ranks", ranks],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--local-ranks must be >= 1" in proc.stderr
