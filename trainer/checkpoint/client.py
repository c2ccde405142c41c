"""The trainer's client for its sidecar's Unix socket (notify, status, flush)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bulkhead.trainer.checkpoint.wire import ProtocolError, request

log = logging.getLogger(__name__)


class SidecarUnavailable(Exception):
    """The sidecar's socket does not answer."""


class SidecarClient:
    def __init__(self, socket_path: Path, timeout: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout

    def call(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        try:
            reply, sock, _ = request(str(self.socket_path), message, timeout or self.timeout)
        except (OSError, ProtocolError) as exc:
            raise SidecarUnavailable(f"checkpoint sidecar at {self.socket_path}: {exc}") from exc
        sock.close()
        return reply

    def notify(self) -> None:
        self.call({"op": "notify"})

    def status(self) -> dict[str, Any]:
        return self.call({"op": "status"})

    def flush(self, stage: str, timeout: float) -> dict[str, Any]:
        """Wait for the newest snapshot to be ``sealed`` or ``done`` (replicated + persisted)."""
        return self.call(
            {"op": "flush", "stage": stage, "timeout": timeout}, timeout + self.timeout
        )
