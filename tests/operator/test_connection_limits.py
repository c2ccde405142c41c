"""The control endpoint, in a process of its own, against idle and slow connections: a
connection that sends no complete headers within the deadline is closed, connections beyond
the cap are refused with one warning that says so, and the endpoint keeps serving
(issue 36: 3,000 idle connections had taken it down for every job)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

CHILD = """
import asyncio, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from bulkhead.operator.control import ControlServer, create_control_app, run_event_loop
from bulkhead.operator.session.job import SessionRegistry

async def main():
    server = ControlServer(create_control_app(SessionRegistry()),
                           headers_deadline_s=1.0, max_connections=20)
    await server.start()
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()

run_event_loop(main())
"""
CAP = 20
DEADLINE_S = 1.0


@pytest.fixture
def endpoint():
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _closed_by_server(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), None if it did not."""
    started = time.monotonic()
    sock.settimeout(within_s)
    try:
        data = sock.recv(1024)
    except TimeoutError:
        return None
    except ConnectionResetError:
        data = b""
    return time.monotonic() - started if data == b"" else None


def test_idle_connections_are_closed_and_the_cap_refuses_the_rest(endpoint) -> None:
    proc, port = endpoint
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    # The listening socket hands connections over in order: this one comes after the CAP.
    beyond = socket.create_connection(("127.0.0.1", port))
    refused_after = _closed_by_server(beyond, within_s=DEADLINE_S / 2)
    assert refused_after is not None, "a connection beyond the cap was kept"
    for sock in idle:  # idle connections go once their headers deadline passes
        closed_after = _closed_by_server(sock, within_s=DEADLINE_S * 10)
        assert closed_after is not None, "an idle connection outlived the headers deadline"
        sock.close()
    beyond.close()
    # A slow but complete request is answered, and the endpoint serves as before.
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        time.sleep(DEADLINE_S / 4)
        slow.sendall(b"\r\n")
        assert slow.recv(1024).startswith(b"HTTP/1.1 200")
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
    proc.stdin.close()
    proc.wait(timeout=30)
    warnings = [line for line in proc.stderr.read().splitlines() if "at its cap of" in line]
    assert len(warnings) == 1, warnings
    assert f"{CAP} connections open, at its cap of {CAP}" in warnings[0]
