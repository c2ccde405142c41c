"""After a failed collective: which peers this worker cannot reach (the suspects it names).

Every member hosts a TCPStore server at the address it registered (``StoreHost``), so a
TCP connect to that address tells a network partition from a dead process:

- connected: the peer is reachable; whatever failed, it was not the path to it;
- refused: its host answers but nothing listens, the process is gone; its exit reaches
  the manager by itself (the kubelet, the local supervisor), so it is not named;
- timed out, no route, or prohibited: unreachable, the peer is named as a suspect.

The manager evicts a worker that most of the members name (``lifecycle.partition``); a
worker cut off from everyone names every peer, but no peer is named by a majority for
that alone.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from typing import Literal

from bulkhead.api.protocol import MembershipView

Reachability = Literal["reachable", "refused", "unreachable"]

# Errors that mean "no path to the peer" rather than "the peer's process is gone".
_UNREACHABLE = {
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EACCES,  # a prohibit route, a firewall reject
    errno.EPERM,
    errno.ETIMEDOUT,
    errno.EHOSTDOWN,
}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _verdict(err: int) -> Reachability:
    if err == 0:
        return "reachable"
    return "unreachable" if err in _UNREACHABLE else "refused"


def probe_all(addresses: list[str], timeout_s: float) -> list[Reachability]:
    """Whether each ``host:port`` accepts a TCP connection, all probed at once (one
    non-blocking connect each, one timeout in all), so a job of thousands of workers
    takes one timeout, not one per peer."""
    results: list[Reachability] = ["unreachable"] * len(addresses)
    selector = selectors.DefaultSelector()
    pending: dict[socket.socket, int] = {}
    try:
        for index, address in enumerate(addresses):
            host, port = _split(address)
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue
            sock.setblocking(False)
            err = sock.connect_ex((host, port))
            if err in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                pending[sock] = index
                selector.register(sock, selectors.EVENT_WRITE)
            else:
                results[index] = _verdict(err)
                sock.close()
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                results[pending.pop(sock)] = _verdict(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                )
                selector.unregister(sock)
                sock.close()
    finally:
        for sock in pending:  # timed out: unreachable
            sock.close()
        selector.close()
    return results


def probe(address: str, timeout_s: float) -> Reachability:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s``."""
    return probe_all([address], timeout_s)[0]


def unreachable_peers(view: MembershipView, me: str, timeout_s: float) -> list[str]:
    """The members of ``view`` other than ``me`` whose address does not answer in time."""
    peers = [m for m in view.members if m.worker != me and m.address]
    results = probe_all([m.address for m in peers], timeout_s)
    return sorted(m.worker for m, r in zip(peers, results, strict=True) if r == "unreachable")
