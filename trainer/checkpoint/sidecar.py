"""``bulkhead-checkpointd``: the sidecar process that seals, replicates and persists snapshots.

It runs next to one trainer (a second container in the worker pod sharing an
``emptyDir{medium: Memory}``, or in local mode a process started by
``bulkhead.operator.local.sidecars``) and never imports torch. The work itself is in
``service.Sidecar``; this module is its command line. Every flag has an environment
variable so the operator can configure the container.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from bulkhead.api.protocol import CHECKPOINT_SOCKET_ENV, SHM_DIR_ENV, TOKEN_ENV
from bulkhead.trainer.checkpoint.paths import (
    DEFAULT_LISTEN,
    DEFAULT_SHM_DIR,
    LISTEN_ENV,
    METRICS_PORT_ENV,
    default_socket,
)
from bulkhead.trainer.checkpoint.service import Sidecar
from bulkhead.trainer.checkpoint.storage import FileStorage

log = logging.getLogger(__name__)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bulkhead-checkpointd", description="Seal, replicate and persist trainer snapshots."
    )
    shm_default = os.environ.get(SHM_DIR_ENV, DEFAULT_SHM_DIR)
    parser.add_argument("--shm-dir", default=shm_default, help=f"[env {SHM_DIR_ENV}]")
    parser.add_argument(
        "--socket",
        default=os.environ.get(CHECKPOINT_SOCKET_ENV),
        help=f"[env {CHECKPOINT_SOCKET_ENV}]",
    )
    parser.add_argument(
        "--listen",
        default=os.environ.get(LISTEN_ENV, DEFAULT_LISTEN),
        help=f"host:port for peer replicas; 'off' disables [env {LISTEN_ENV}]",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get(METRICS_PORT_ENV, "0")),
        help=f"Prometheus port; 0 = off [env {METRICS_PORT_ENV}]",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--max-write-mbps", type=float, default=0.0, help="0 = unlimited")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--lock-timeout", type=float, default=60.0)
    parser.add_argument("--peer-timeout", type=float, default=60.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    shm_dir = Path(args.shm_dir)
    rate = args.max_write_mbps * 1e6 if args.max_write_mbps > 0 else None
    sidecar = Sidecar(
        shm_dir=shm_dir,
        socket_path=Path(args.socket) if args.socket else default_socket(shm_dir),
        listen=None if args.listen == "off" else args.listen,
        token=os.environ.get(TOKEN_ENV) or None,
        storage_factory=lambda root: FileStorage(root, max_write_bytes_per_s=rate),
        poll_interval=args.poll_interval,
        lock_timeout=args.lock_timeout,
        peer_timeout=args.peer_timeout,
    )
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    sidecar.start()
    stopping.wait()
    log.info("stopping: draining exports for up to %.0fs", args.drain_timeout)
    sidecar.stop(args.drain_timeout)


if __name__ == "__main__":
    main()
