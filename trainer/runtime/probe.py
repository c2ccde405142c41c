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
import socket
from concurrent.futures import ThreadPoolExecutor
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


def probe(address: str, timeout_s: float) -> Reachability:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return "reachable"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "unreachable"
    except OSError as exc:
        return "unreachable" if exc.errno in _UNREACHABLE else "refused"


def unreachable_peers(view: MembershipView, me: str, timeout_s: float) -> list[str]:
    """The members of ``view`` other than ``me`` whose address does not answer in time,
    probed in parallel (one timeout in all, not one per peer)."""
    peers = [m for m in view.members if m.worker != me and m.address]
    if not peers:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(peers))) as pool:
        results = list(pool.map(lambda m: probe(m.address, timeout_s), peers))
    return sorted(m.worker for m, r in zip(peers, results, strict=True) if r == "unreachable")
