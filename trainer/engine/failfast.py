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

_PROC = Path("/proc")


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    fd: int
    local_port: int
    remote_port: int  # 0 when not connected
    listening: bool


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


def describe_tcp(fd: int, inode: int) -> TcpSocket | None:
    """The TCP socket behind this process's descriptor ``fd`` (None: not TCP, or closed).

    Asked of the socket itself (a duplicate descriptor): reading ``/proc/net/tcp`` instead
    walks every socket of the machine, 12 ms of CPU here per read, twice per rank and
    generation (a third of a survivor's CPU in recovering from a lost worker).
    """
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None  # closed meanwhile, or not a socket any more
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        try:
            local_port = sock.getsockname()[1]
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        except OSError:
            return None
        try:
            remote_port = 0 if listening else sock.getpeername()[1]
        except OSError:  # not connected (any more)
            remote_port = 0
    return TcpSocket(inode, fd, local_port, remote_port, listening)


def new_tcp_sockets(before: set[int]) -> list[TcpSocket]:
    """This process's TCP sockets opened since ``before`` (a set of inodes), by fd."""
    found = (
        describe_tcp(fd, inode) for inode, fd in own_socket_fds().items() if inode not in before
    )
    return [s for s in found if s is not None]


def new_listen_ports(before: set[int]) -> list[int]:
    """Ports of TCP listeners this process opened since ``before`` (a set of inodes)."""
    return sorted({s.local_port for s in new_tcp_sockets(before) if s.listening})


def generation_connections(
    before: set[int], own_ports: list[int], peer_ports: set[int]
) -> dict[int, int]:
    """The generation's gloo connections (inode -> fd) among sockets opened after ``before``."""
    return {
        s.inode: s.fd
        for s in new_tcp_sockets(before)
        if not s.listening and (s.local_port in own_ports or s.remote_port in peer_ports)
    }


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
