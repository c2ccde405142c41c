"""The peer probe after a failed collective: a listening peer is reachable, a closed port
means a dead process (not named), a peer behind a prohibit route is named."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from bulkhead.api.protocol import MembershipView
from bulkhead.api.status import Member
from bulkhead.trainer.runtime.probe import probe, unreachable_peers


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listening_is_reachable_and_a_closed_port_is_a_dead_process() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert probe(f"127.0.0.1:{port}", 1.0) == "reachable"
        closed = _closed_port()
        assert probe(f"127.0.0.1:{closed}", 1.0) == "refused"
        view = MembershipView(
            generation=1,
            members=[
                Member(rank=0, worker="me", address="127.0.0.1:1"),
                Member(rank=1, worker="up", address=f"127.0.0.1:{port}"),
                Member(rank=2, worker="dead", address=f"127.0.0.1:{closed}"),
            ],
        )
        assert unreachable_peers(view, "me", 1.0) == []


def test_a_peer_behind_a_prohibit_route_is_named() -> None:
    """In a network namespace of its own: 10.77.0.2 is prohibited, 127.0.0.1 answers."""
    script = textwrap.dedent(
        """
        import socket
        from bulkhead.api.protocol import MembershipView
        from bulkhead.api.status import Member
        from bulkhead.trainer.runtime.probe import probe, unreachable_peers
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        view = MembershipView(generation=1, members=[
            Member(rank=0, worker="me", address="127.0.0.1:1"),
            Member(rank=1, worker="up", address=f"127.0.0.1:{port}"),
            Member(rank=2, worker="cut", address="10.77.0.2:4000"),
        ])
        print(probe("10.77.0.2:4000", 1.0), unreachable_peers(view, "me", 1.0))
        """
    )
    shell = (
        "ip link set lo up && ip route add prohibit 10.77.0.2/32 && "
        f"exec {sys.executable} -c '{script}'"
    )
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", shell], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "unreachable"
    assert proc.stdout.strip().endswith("['cut']")
