"""Cutting the TCP connections of a failed gloo generation, so every member fails at once.

When a peer dies, gloo fails only the ranks that talk to it directly in the running
algorithm; the others stay blocked inside the library (FSDP2's collectives cannot be
polled) until the group timeout, and neither ``abort()`` nor a call from another thread
wakes them (verified on torch 2.15; pytorch#130345). What does wake a rank is its peer's socket
closing. So a rank that sees its generation fail shuts down every connection of that
generation's groups: its neighbours fail at once, do the same, and the error reaches the
whole world in a few round trips instead of a timeout.

The connections are found exactly: sockets opened while the generation formed and built
its groups, that either were accepted on one of this rank's new gloo listeners or lead to
a listener a peer published for the same generation. Store, control and agent
connections are never touched. Linux only (``/proc``); elsewhere cutting is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_LISTEN = "0A"
_ESTABLISHED = "01"
_PROC = Path("/proc")


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    local_port: int
    remote_port: int
    state: str


def _parse_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)


def parse_proc_net_tcp(text: str) -> dict[int, TcpSocket]:
    """Sockets by inode from the text of ``/proc/net/tcp`` or ``/proc/net/tcp6``."""
    out: dict[int, TcpSocket] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        inode = int(parts[9])
        if inode:
            out[inode] = TcpSocket(inode, _parse_port(parts[1]), _parse_port(parts[2]), parts[3])
    return out


def own_socket_fds() -> dict[int, int]:
    """This process's open sockets: inode -> file descriptor."""
    out: dict[int, int] = {}
    fd_dir = _PROC / "self" / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def tcp_table() -> dict[int, TcpSocket]:
    table: dict[int, TcpSocket] = {}
    for name in ("tcp", "tcp6"):
        try:
            table |= parse_proc_net_tcp((_PROC / "net" / name).read_text())
        except OSError:
            continue
    return table


def new_listen_ports(before: set[int]) -> list[int]:
    """Ports of TCP listeners this process opened since ``before`` (a set of inodes)."""
    table = tcp_table()
    return sorted(
        {
            table[inode].local_port
            for inode in own_socket_fds().keys() - before
            if inode in table and table[inode].state == _LISTEN
        }
    )


def generation_connections(
    before: set[int], own_ports: list[int], peer_ports: set[int]
) -> dict[int, int]:
    """The generation's gloo connections (inode -> fd) among sockets opened after ``before``."""
    table = tcp_table()
    out = {}
    for inode, fd in own_socket_fds().items():
        sock = table.get(inode)
        if inode in before or sock is None or sock.state == _LISTEN:
            continue
        if sock.local_port in own_ports or sock.remote_port in peer_ports:
            out[inode] = fd
    return out


@dataclass
class Connections:
    """The connections of one generation, recorded once its groups exist; ``cut`` ends them."""

    sockets: dict[int, int] = field(default_factory=dict)  # inode -> fd
    cut_done: bool = False

    def cut(self) -> int:
        """Shut down every recorded connection still open; returns how many were cut."""
        if self.cut_done:
            return 0
        self.cut_done = True
        live = own_socket_fds()
        count = 0
        for inode, fd in self.sockets.items():
            if live.get(inode) != fd:
                continue  # gloo closed it already (and the number may be reused)
            try:
                # A duplicate descriptor: shutdown acts on the connection, and closing the
                # duplicate leaves gloo's own descriptor valid until gloo closes it.
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError as exc:
                log.debug("cutting socket %d: %s", fd, exc)
        return count
