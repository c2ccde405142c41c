"""``bulkhead-checkpointd``: the sidecar process that seals, replicates and persists snapshots.

It runs next to one trainer, or, with ``--local-ranks G``, one service per trainer
process of a pod that runs G of them (a second container in the worker pod sharing an
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

from bulkhead.api.protocol import CHECKPOINT_SOCKET_ENV, SHM_DIR_ENV, replica_token
from bulkhead.trainer.checkpoint.paths import (
    DEFAULT_LISTEN,
    DEFAULT_SHM_DIR,
    LISTEN_ENV,
    LOCAL_RANKS_ENV,
    METRICS_PORT_ENV,
    default_socket,
    local_rank_shm_dir,
)
from bulkhead.trainer.checkpoint.sidecar import Sidecar
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
    parser.add_argument(
        "--local-ranks",
        type=int,
        default=int(os.environ.get(LOCAL_RANKS_ENV, "1")),
        help=(
            "Trainer processes in the pod; with more than 1, one service each in "
            "<shm-dir>/rank-<i> (its own socket there), replicas on the listen port + i "
            f"[env {LOCAL_RANKS_ENV}]"
        ),
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.local_ranks < 1:
        parser.error(f"--local-ranks must be >= 1, got {args.local_ranks}")
    if args.local_ranks > 1 and args.socket:
        parser.error("--socket names one socket; with --local-ranks > 1 each is in its rank dir")
    return args


def _listen_of(listen: str | None, local_rank: int) -> str | None:
    """Local rank ``local_rank``'s replica address: the port + ``local_rank`` (0 stays 0,
    any free port)."""
    if listen is None or local_rank == 0:
        return listen
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + local_rank if int(port) else 0}"


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    shm_root = Path(args.shm_dir)
    rate = args.max_write_mbps * 1e6 if args.max_write_mbps > 0 else None
    listen = None if args.listen == "off" else args.listen
    sidecars = []
    for rank in range(args.local_ranks):
        shm_dir = shm_root if args.local_ranks == 1 else local_rank_shm_dir(shm_root, rank)
        shm_dir.mkdir(parents=True, exist_ok=True)
        sidecars.append(
            Sidecar(
                shm_dir=shm_dir,
                socket_path=Path(args.socket) if args.socket else default_socket(shm_dir),
                listen=_listen_of(listen, rank),
                token=replica_token(os.environ),
                storage_factory=lambda root: FileStorage(root, max_write_bytes_per_s=rate),
                poll_interval=args.poll_interval,
                lock_timeout=args.lock_timeout,
                peer_timeout=args.peer_timeout,
            )
        )
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    for sidecar in sidecars:
        sidecar.start()
    stopping.wait()
    log.info("stopping: draining exports for up to %.0fs", args.drain_timeout)
    for sidecar in sidecars:  # one after another: the drain is a bound on the whole stop
        sidecar.stop(args.drain_timeout)


if __name__ == "__main__":
    main()
