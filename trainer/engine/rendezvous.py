"""The rendezvous of a membership generation: the coordinator's store and the check-in.

Every worker hosts a TCPStore server (``StoreHost``) from the start, so whichever becomes
a generation's coordinator already serves one. Members reach it over one connection per
coordinator for as long as it stays (``coordinator_store``), then check in
(``check_in``): a polled wait that a newer generation cuts short, with one outcome decided
once in the store, so either every member goes on to ``init_process_group`` or none does.
The waits here poll with a backoff (``poll_until``) because the library's own waits cannot
be abandoned.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

# Polling an in-flight collective: start fine-grained (steps take milliseconds), back off.
FIRST_POLL_S = 0.0002
MAX_POLL_S = 0.02
# A rendezvous check-in polls fine-grained for this long, then every _CHECK_IN_LATE_POLL_S.
_CHECK_IN_POLL_S = 1.0
_CHECK_IN_LATE_POLL_S = 0.25
# A store that takes longer than this to answer a look-up was stalled (a round trip takes
# milliseconds): a check-in does not count the rest against the members still arriving.
_STORE_ANSWER_S = 0.5


class CollectiveError(RuntimeError):
    """A rendezvous or collective failed or timed out (a peer died, hung or went away)."""


class StoreHost:
    """The TCPStore server this worker hosts for the generations it coordinates.

    Every worker hosts one from the start (on a free port it registers as its address), so
    whichever worker becomes the coordinator already serves one, and a coordinator that
    survives keeps serving across generations.
    """

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host = host
        listener = listen_on(host)
        port = listener.getsockname()[1]
        # The store takes the listener over (and closes it with itself).
        self.store = dist.TCPStore(
            host,
            port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        self.port = self.store.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def listen_on(host: str) -> socket.socket:
    """A listening socket on ``host`` itself, in that address's family, on a free port.

    Left to itself, a TCPStore server listens on every interface over IPv6, so a peer
    connecting over IPv4 is accepted as ``::ffff:<its address>``, and the server formats
    every accepted peer's address with a reverse name lookup, in its event loop: for that
    form of the address /etc/hosts has no answer, so it is a DNS query (seen with strace),
    and a query the resolver drops freezes the store for the resolver's 5 s timeout (5
    lookups in 300 here). Every new client, ``await_listener``'s probe and the partition
    probe of every collective-error report is such a connection, and a frozen coordinator's
    store holds every member's check-in, which then fails as if the members still arriving
    had not come (``rank(s) [..] did not check in``). Accepted on the host's own family,
    a peer is the address itself, which /etc/hosts answers without a query (127.0.0.1 in
    local mode).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def never() -> bool:
    """The default ``should_abandon``: no newer generation ever cuts the wait short."""
    return False


# This process's client of the coordinator's store, by the coordinator's address (at most
# one): every generation with the same coordinator rendezvouses over the same connection.
_CLIENTS: dict[str, dist.Store] = {}


def coordinator_store(
    address: str, generation: int, timeout_s: float, should_abandon: Callable[[], bool] = never
) -> dist.Store:
    """A client of the store at ``address`` (``host:port``): the one this process already
    has when it still answers, else a new connection.

    Survivors of a lost worker keep their coordinator, so they reuse the connection they
    have: a new TCPStore client per generation took 5.0 s now and then on this machine
    (survivors of one worker of 8 lost, ZeRO-3, at load 10-30), holding everyone else at
    the check-in, while a round trip on the open connection takes milliseconds. The 5 s is
    torch's: before connecting, its client looks up the store address's name (a reverse
    DNS query, seen with strace: PTR 1.0.0.127.in-addr.arpa for ::ffff:127.0.0.1, which
    /etc/hosts does not answer), and a query the resolver drops is retried after its 5 s
    timeout (1 lookup in 60 here). A new process's first connection still pays it.
    """
    client = _CLIENTS.get(address)
    if client is not None:
        try:
            client.check(["alive"])  # one round trip: the connection and its server live
            return client
        except (RuntimeError, dist.DistError) as exc:
            log.info(
                "generation %d: connection to the store at %s lost (%s): reconnecting",
                generation,
                address,
                exc,
            )
    _CLIENTS.clear()  # a client of a former coordinator's store is not needed again
    host, _, port = address.rpartition(":")
    await_listener(host, int(port), generation, timeout_s, should_abandon)
    client = dist.TCPStore(
        host, int(port), None, False, timedelta(seconds=timeout_s), wait_for_workers=False
    )
    _CLIENTS[address] = client
    return client


def check_in(
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    should_abandon: Callable[[], bool] = never,
) -> None:
    """Wait until every member of the generation has checked in, or give up at once when
    a newer generation exists.

    ``init_process_group`` waits on the store in the library, unabandonable: a member that
    died after the generation was published would hold every survivor there for the whole
    collective timeout, although the manager has already published the next generation.
    Checking in first, polled, leaves the library's waits only live members to wait for.

    The outcome is one store value, decided once (compare-and-set): the last member in
    writes ``go``, a member giving up writes why (abandoned, or who is missing). Either every
    member goes on to the init or none does, so no member is left waiting in the library
    for one that gave up a moment after everyone had checked in.

    The timeout counts the time the store answered: while it is stalled (its process
    frozen, its event loop held by a slow name lookup) nobody can check in, and members
    queued behind the stall are not late. Nor does anyone give up while every member has
    checked in (the last one's ``go`` is on its way), up to twice the timeout.
    """
    store.set(f"checked-in/{rank}", b"1")
    if store.add("arrivals", 1) == world_size:
        _decide(store, "go")
    stalled = [0.0]  # seconds the store took to answer beyond _STORE_ANSWER_S

    def decided() -> bool:
        asked = time.monotonic()
        answer = store.check(["outcome"])
        stalled[0] += max(0.0, time.monotonic() - asked - _STORE_ANSWER_S)
        return answer

    def check(elapsed: float) -> None:  # a decision here ends the poll at its next look
        if should_abandon():
            _decide(store, "abandoned: a newer generation exists")
        elif elapsed - stalled[0] > timeout_s:
            missing = [r for r in range(world_size) if not store.check([f"checked-in/{r}"])]
            if missing or elapsed > 2 * timeout_s:
                _decide(store, f"failed: rank(s) {missing} did not check in within {timeout_s:g}s")

    def pause(elapsed: float, backoff_s: float) -> None:
        # Members usually arrive within milliseconds of each other; once one is late, a
        # slower poll keeps thousands of ranks from loading the store. Not a store wait
        # in slices (as many requests: a wait that times out is cancelled by a second):
        # torch logs each timed-out wait with both socket addresses, formatted by reverse
        # name lookups, and a lookup the resolver drops held the waiting rank for 5 s
        # (``listen_on``), past the moment the last member arrived.
        time.sleep(backoff_s if elapsed < _CHECK_IN_POLL_S else _CHECK_IN_LATE_POLL_S)

    poll_until(decided, check, pause)
    outcome = store.get("outcome").decode()
    if outcome != "go":
        raise CollectiveError(f"generation {generation}: rendezvous {outcome}")


def _decide(store: dist.Store, outcome: str) -> None:
    """Write the rendezvous' outcome unless a member already did (then theirs stands)."""
    store.compare_set("outcome", "", outcome)


def await_listener(
    host: str,
    port: int,
    generation: int,
    timeout_s: float,
    should_abandon: Callable[[], bool] = never,
) -> None:
    """Wait until the coordinator's store accepts connections, or give up at once when a
    newer generation exists.

    The TCPStore client retries its connect inside the library for the whole timeout: a
    coordinator that died after the generation was published would hold every survivor
    there, past the next generation the manager has already published.
    """
    refused: list[OSError] = []  # the last connect's error

    def accepts() -> bool:
        try:
            probe = socket.create_connection((host, port), timeout=min(1.0, timeout_s))
        except OSError as exc:
            refused[:] = [exc]
            return False
        probe.close()
        return True

    def check(elapsed: float) -> None:
        if should_abandon():
            raise CollectiveError(
                f"generation {generation}: rendezvous abandoned: a newer generation exists"
            ) from refused[0]
        if elapsed > timeout_s:
            raise CollectiveError(
                f"generation {generation}: store at {host}:{port} unreachable for "
                f"{timeout_s:g}s: {refused[0]}"
            ) from refused[0]

    poll_until(accepts, check)


def poll_until(
    done: Callable[[], bool],
    check: Callable[[float], None],
    pause: Callable[[float, float], None] | None = None,
) -> None:
    """The poll-with-backoff loop of this module's waits, which a newer generation must be
    able to cut short (the library's own waits cannot be).

    Until ``done()``: ``check(seconds since the start)``, which raises to give up (or
    settles what ``done`` reads), then ``pause(elapsed, backoff)``: by default a sleep of the
    backoff, which starts fine-grained (steps take milliseconds) and doubles up to
    ``MAX_POLL_S``.
    """
    started = time.monotonic()
    backoff = FIRST_POLL_S
    while not done():
        elapsed = time.monotonic() - started
        check(elapsed)
        if pause is None:
            time.sleep(backoff)
        else:
            pause(elapsed, backoff)
        backoff = min(backoff * 2, MAX_POLL_S)
