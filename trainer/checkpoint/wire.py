"""Framing shared by the sidecar's Unix socket and its replica TCP port.

A message is one JSON line, optionally followed by exactly ``nbytes`` of raw payload.
"""

from __future__ import annotations

import json
import socket
from io import BufferedReader
from typing import Any

import crc32c

MAX_LINE_BYTES = 64 << 20  # a header carries a pickled skeleton: generous, but bounded
PAYLOAD_CHUNK_BYTES = 4 << 20


class ProtocolError(Exception):
    """The other side sent something malformed or closed the connection early."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def recv_message(reader: BufferedReader, limit: int = MAX_LINE_BYTES) -> dict[str, Any]:
    """One JSON object line of at most ``limit`` bytes (read no further)."""
    line = reader.readline(limit + 1)
    if not line:
        raise ProtocolError("connection closed before a message arrived")
    if len(line) > limit or not line.endswith(b"\n"):
        raise ProtocolError("message line too long or truncated")
    try:
        message = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object")
    return message


def send_payload(sock: socket.socket, data: memoryview) -> None:
    for start in range(0, len(data), PAYLOAD_CHUNK_BYTES):
        sock.sendall(data[start : start + PAYLOAD_CHUNK_BYTES])


def recv_payload_into(reader: BufferedReader, buffer: memoryview) -> int:
    """Fill ``buffer`` exactly from the stream; returns the CRC-32C of what arrived."""
    crc = 0
    for start in range(0, len(buffer), PAYLOAD_CHUNK_BYTES):
        chunk = buffer[start : start + PAYLOAD_CHUNK_BYTES]
        filled = 0
        while filled < len(chunk):
            got = reader.readinto(chunk[filled:])
            if not got:
                raise ProtocolError(f"payload ended early at byte {start + filled}")
            filled += got
        crc = crc32c.crc32c(chunk, crc)
    return crc


def request(
    address: str | tuple[str, int],
    message: dict[str, Any],
    timeout: float,
    payload: memoryview | None = None,
    credentials: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], socket.socket, BufferedReader]:
    """Send one message (+ payload) and read the reply; the caller closes the socket.

    ``credentials`` go first on a short line of their own, so a server can check them
    before it reads a large message."""
    if isinstance(address, tuple):
        sock = socket.create_connection(address, timeout=timeout)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
    try:
        reader = sock.makefile("rb")
        if credentials is not None:
            send_message(sock, credentials)
        send_message(sock, message)
        if payload is not None:
            send_payload(sock, payload)
        return recv_message(reader), sock, reader
    except BaseException:
        sock.close()
        raise


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
