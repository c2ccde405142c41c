"""The world's edges: cutting a failed generation's connections, parking a registry,
picking the device. In-process, with real sockets and a real one-rank gloo group."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from bulkhead.trainer.engine import rendezvous
from bulkhead.trainer.engine.device import (
    NCCL_RECOVERY_ENV,
    AbortMonitor,
    DeviceChoice,
    activate,
    pick_device,
)
from bulkhead.trainer.engine.failfast import (
    Connections,
    TcpSocket,
    describe_tcp,
    generation_connections,
    new_listen_ports,
    own_socket_fds,
)
from bulkhead.trainer.engine.rendezvous import (
    FIRST_POLL_S,
    MAX_POLL_S,
    StoreHost,
    await_listener,
    check_in,
    coordinator_store,
    poll_until,
)
from bulkhead.trainer.engine.world import (
    CollectiveError,
    World,
    open_world,
    park_default_world,
)


def test_only_tcp_sockets_are_described() -> None:
    pair = socket.socketpair()  # AF_UNIX: never a generation's connection
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    try:
        assert describe_tcp(pair[0].fileno(), 1) is None
        assert describe_tcp(udp.fileno(), 2) is None
        port = listener.getsockname()[1]
        assert describe_tcp(listener.fileno(), 3) == TcpSocket(3, listener.fileno(), port, 0, True)
        described = describe_tcp(client.fileno(), 4)
        assert described is not None and not described.listening
        assert (described.local_port, described.remote_port) == (client.getsockname()[1], port)
        closed = os.dup(client.fileno())
        os.close(closed)
        assert describe_tcp(closed, 5) is None  # closed meanwhile
    finally:
        for s in (*pair, udp, listener, client):
            s.close()


def test_only_the_generations_connections_are_cut() -> None:
    unrelated = socket.create_server(("127.0.0.1", 0))
    other_client = socket.create_connection(unrelated.getsockname())
    other_server, _ = unrelated.accept()
    before = set(own_socket_fds())
    listener = socket.create_server(("127.0.0.1", 0))  # stands for a gloo listener
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        ports = new_listen_ports(before)
        assert ports == [listener.getsockname()[1]]
        found = generation_connections(before, ports, set(ports))
        assert set(found.values()) == {client.fileno(), accepted.fileno()}
        connections = Connections(found)
        assert connections.cut() == 2
        assert connections.cut() == 0  # once only
        # Both ends see the connection end at once; the descriptors themselves stay valid.
        assert client.recv(1) == b"" and accepted.recv(1) == b""
        other_client.sendall(b"x")
        assert other_server.recv(1) == b"x"  # untouched
    finally:
        for s in (unrelated, other_client, other_server, listener, client, accepted):
            s.close()


def test_a_blocked_reader_wakes_when_its_peer_cuts() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    before = set(own_socket_fds())
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(accepted.recv(1)))
    reader.start()
    found = generation_connections(before, [], {listener.getsockname()[1]})
    assert set(found.values()) == {client.fileno()}
    Connections(found).cut()
    reader.join(timeout=10)
    assert not reader.is_alive() and got == [b""]
    for s in (listener, client, accepted):
        s.close()


def test_parking_forgets_the_registry_and_the_next_world_forms() -> None:
    # Guards the private torch registry park_default_world relies on: a torch upgrade that
    # changes it fails here, loudly.
    store = dist.HashStore()
    device = pick_device(cuda_available=False)
    first = open_world(1, 0, ["w0"], ["n0"], store, device, timeout_s=10)
    sub = dist.new_group([0])
    assert dist.is_initialized() and len(c10d._world.pg_map) == 2
    park_default_world()
    assert not dist.is_initialized() and not c10d._world.pg_map
    second = open_world(2, 0, ["w0"], ["n0"], store, device, timeout_s=10)
    try:
        t = torch.ones(3)
        second.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
        assert second.generation == 2 and first is not second and sub is not None
    finally:
        second.close()
    assert not dist.is_initialized()


def test_a_generations_subgroups_time_out_as_its_world_does() -> None:
    # torch's default for new groups is 30 min on gloo: a rank blocked in a shard or replica
    # group of a cut generation would wait there long after the others moved on.
    world = open_world(1, 0, ["w0"], ["n0"], dist.HashStore(), pick_device(cuda_available=False),
                       timeout_s=6)  # fmt: skip
    try:
        sub = dist.new_group([0])
        assert sub._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=6)
    finally:
        world.close()


def test_a_failed_rendezvous_leaves_the_next_world_named_as_in_a_fresh_process() -> None:
    # A rank whose rendezvous timed out (a member of its generation was dead) must name
    # the next world's groups as a newcomer's fresh process does, or both wait on
    # different store keys until they time out.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=1),
                          wait_for_workers=False)  # fmt: skip
    device = pick_device(cuda_available=False)
    store.set("gen1/checked-in/1", "1")  # rank 1 checked in, then died before the init
    store.add("gen1/arrivals", 1)
    with pytest.raises(CollectiveError, match="rendezvous failed"):
        open_world(1, 0, ["w0", "w1"], ["n0", "n1"], store, device, timeout_s=1)
    assert not dist.is_initialized()
    world = open_world(2, 0, ["w0"], ["n0"], store, device, timeout_s=10)
    try:
        assert c10d._get_default_group().group_name == "0"  # a fresh process's first name
    finally:
        world.close()


def test_a_rendezvous_with_a_dead_member_ends_when_a_newer_generation_exists() -> None:
    # The manager published generation 2 after generation 1's rank 1 died: the survivor
    # gives up generation 1 at once instead of waiting out the collective timeout.
    store = dist.HashStore()
    device = pick_device(cuda_available=False)
    newer = threading.Event()
    threading.Timer(0.2, newer.set).start()
    with pytest.raises(CollectiveError, match="abandoned: a newer generation exists"):
        open_world(1, 0, ["w0", "w1"], ["n0", "n1"], store, device, timeout_s=60,
                   should_abandon=newer.is_set)  # fmt: skip
    assert not dist.is_initialized()
    # A member late by more than the polling phase: the survivor waits in the store
    # between looks and still gives up when the newer generation appears.
    later = threading.Event()
    threading.Timer(1.5, later.set).start()
    with pytest.raises(CollectiveError, match="abandoned: a newer generation exists"):
        open_world(2, 0, ["w0", "w1"], ["n0", "n1"], store, device, timeout_s=60,
                   should_abandon=later.is_set)  # fmt: skip
    # A member that arrives after the others gave up does not go on alone.
    with pytest.raises(CollectiveError, match="abandoned: a newer generation exists"):
        check_in(dist.PrefixStore("gen1", store), 1, 1, 2, timeout_s=60)
    # Without a newer generation, the timeout names who never came.
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[1, 2\] did not check in"):
        open_world(3, 0, ["w0", "w1", "w2"], ["n0"] * 3, store, device, timeout_s=0.3)


def test_device_choice_and_the_nccl_environment() -> None:
    cpu = pick_device(cuda_available=False)
    assert (cpu.device.type, cpu.backend, cpu.is_cuda) == ("cpu", "gloo", False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="local rank 1 needs GPU 1"):
            pick_device(local_rank=1, cuda_available=True)
    env: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    activate(DeviceChoice(torch.device("cpu"), "nccl"), env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # what the user set wins
    assert all(
        env[k] == v for k, v in NCCL_RECOVERY_ENV.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    )
    untouched: dict[str, str] = {}
    activate(cpu, untouched)
    assert untouched == {}


def test_abort_monitor_fires_once_and_survives_a_broken_predicate() -> None:
    answers = iter([RuntimeError("flaky"), False, True])

    def should_abort() -> bool:
        answer = next(answers, True)
        if isinstance(answer, Exception):
            raise answer
        return answer

    aborted: list[int] = []
    monitor = AbortMonitor(should_abort, lambda: aborted.append(1), interval_s=0.01).start()
    assert monitor.fired.wait(10)
    monitor.stop()
    assert aborted == [1]


def test_a_main_thread_that_never_leaves_an_aborted_generation_is_reported_wedged() -> None:
    wedged = threading.Event()
    monitor = AbortMonitor(
        lambda: True, lambda: None, interval_s=0.01, wedged=wedged.set, wedged_after_s=0.05
    ).start()
    assert wedged.wait(10)  # nobody stopped it: the aborted generation was never left
    # Stopped within the delay (the main thread left the generation): not wedged.
    left = threading.Event()
    monitor = AbortMonitor(lambda: True, lambda: None, interval_s=0.01, wedged=left.set,
                           wedged_after_s=30).start()  # fmt: skip
    assert monitor.fired.wait(10)
    monitor.stop()
    assert not left.is_set()


def test_an_abandoned_world_stays_abandoned_when_its_collective_then_fails() -> None:
    # The abort makes the main thread's collective fail; that failure must not turn the
    # world into a failed one, which ``close`` would shut down (waiting for what is in flight).
    world = World(1, 0, 1, ["w"], ["n"], pick_device(cuda_available=False))
    world.abort("a newer generation exists")
    world._fail("forward/backward: connection closed", abandoned=False)
    assert world._state == "abandoned"


def test_waiting_for_a_dead_coordinators_store_ends_when_a_newer_generation_exists() -> None:
    with socket.socket() as closed:  # a port nobody listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    newer = threading.Event()
    threading.Timer(0.2, newer.set).start()
    with pytest.raises(CollectiveError, match="abandoned: a newer generation exists"):
        await_listener("127.0.0.1", port, 1, timeout_s=60, should_abandon=newer.is_set)
    with pytest.raises(CollectiveError, match=r"unreachable for 0\.2s"):
        await_listener("127.0.0.1", port, 1, timeout_s=0.2)
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        await_listener("127.0.0.1", live.getsockname()[1], 1, timeout_s=5)  # returns at once


def test_a_coordinators_store_is_reached_over_one_connection_while_it_answers() -> None:
    first, second = StoreHost("127.0.0.1", 10), StoreHost("127.0.0.1", 10)
    client = coordinator_store(first.address, 1, timeout_s=5)
    client.set("seen", "1")
    # The next generation with the same coordinator: the same connection, no new one.
    before = set(own_socket_fds())
    assert coordinator_store(first.address, 2, timeout_s=5) is client
    assert set(own_socket_fds()) == before
    # Another coordinator: a connection of its own, to its store.
    other = coordinator_store(second.address, 3, timeout_s=5)
    assert other is not client and not other.check(["seen"])
    # Its server gone (its process died): a connection that no longer answers is not
    # reused, and no new one can be made.
    address = second.address
    del other, second
    with pytest.raises(CollectiveError, match="unreachable"):
        coordinator_store(address, 4, timeout_s=0.3)


def _listening(table: str, port: int) -> list[str]:
    """Local addresses (hex, as the kernel shows them) listening on ``port`` in
    /proc/self/net/``table``."""
    rows = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
    fields = [row.split() for row in rows]
    return [
        f[1].split(":")[0] for f in fields if int(f[1].split(":")[1], 16) == port and f[3] == "0A"
    ]


def test_a_store_host_listens_on_its_own_address_not_on_every_interface_over_ipv6() -> None:
    # A TCPStore server left to itself listens on [::] and sees an IPv4 peer as
    # ::ffff:127.0.0.1, whose reverse name lookup (for its accept's log line, in its event
    # loop) /etc/hosts cannot answer: a DNS query per connection, and a dropped one froze
    # the coordinator's store for 5 s (the check-in of every member with it).
    host = StoreHost("127.0.0.1", 10)
    assert _listening("tcp", host.port) == ["0100007F"]  # 127.0.0.1, IPv4
    assert _listening("tcp6", host.port) == []
    client = coordinator_store(host.address, 1, timeout_s=5)
    client.set("seen", "1")
    assert host.store.get("seen") == b"1"


def test_a_check_in_waiting_for_a_late_member_makes_no_store_wait_time_out(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch logs a store wait that times out with both socket addresses, each formatted by
    # a reverse name lookup: a dropped DNS query held the waiting member for 5 s. Waiting
    # for a late member must not go through timed-out waits.
    monkeypatch.setattr(rendezvous, "_CHECK_IN_POLL_S", 0.0)  # the late member's path at once
    host = StoreHost("127.0.0.1", 10)
    waiting = dist.PrefixStore("gen1", coordinator_store(host.address, 1, timeout_s=5))
    late = dist.PrefixStore("gen1", dist.TCPStore(
        "127.0.0.1", host.port, None, False, timedelta(seconds=5), wait_for_workers=False
    ))  # fmt: skip
    capfd.readouterr()

    def arrive_late() -> None:
        while not late.check(["checked-in/0"]):
            time.sleep(0.01)
        time.sleep(0.8)  # late: a wait in 0.5 s slices would have timed out
        check_in(late, 1, 1, 2, timeout_s=10)

    thread = threading.Thread(target=arrive_late)
    thread.start()
    check_in(waiting, 1, 0, 2, timeout_s=10)
    thread.join()
    assert waiting.get("outcome") == b"go"
    assert "timed out" not in capfd.readouterr().err


_STORE_SERVER = """
import signal, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
signal.pause()
"""


def test_a_member_queued_behind_a_stalled_store_is_not_late() -> None:
    # The coordinator's store stalls (its process frozen here; a dropped DNS query in its
    # event loop did the same for 5 s) for longer than the check-in timeout while rank 1
    # is on its way: rank 1 checks in once the store answers again, and the rendezvous
    # completes instead of failing with "rank(s) [1] did not check in".
    server = subprocess.Popen([sys.executable, "-c", _STORE_SERVER], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())

        def client() -> dist.Store:
            return dist.PrefixStore("gen1", dist.TCPStore(
                "127.0.0.1", port, None, False, timedelta(seconds=30), wait_for_workers=False
            ))  # fmt: skip

        waiting, late = client(), client()
        answered = threading.Event()

        def arrive_after_the_stall() -> None:
            while not late.check(["checked-in/0"]):
                time.sleep(0.01)
            server.send_signal(signal.SIGSTOP)
            time.sleep(5.0)  # the stall: longer than the 3 s timeout
            server.send_signal(signal.SIGCONT)
            late.check(["checked-in/0"])  # the store answers again
            answered.set()
            time.sleep(0.5)  # rank 1 arrives a moment later
            check_in(late, 1, 1, 2, timeout_s=3)

        thread = threading.Thread(target=arrive_after_the_stall)
        thread.start()
        check_in(waiting, 1, 0, 2, timeout_s=3)
        thread.join()
        assert answered.is_set() and waiting.get("outcome") == b"go"
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()


def test_once_every_member_checked_in_nobody_gives_up() -> None:
    # Rank 1 is in; rank 0 arrives last while a newer generation exists: the rendezvous is
    # already complete, so rank 0 goes on to the init as rank 1 does (neither is stranded
    # in the library's wait for a member that left).
    store = dist.HashStore()
    store.set("checked-in/1", "1")
    store.add("arrivals", 1)
    check_in(store, 1, 0, 2, timeout_s=60, should_abandon=lambda: True)
    assert store.get("outcome") == b"go"


def test_the_poll_loop_backs_off_to_its_cap_and_ends_when_done_or_when_check_gives_up() -> None:
    pauses: list[float] = []
    answers = iter([False] * 12 + [True])
    poll_until(lambda: next(answers), lambda _: None, lambda _, backoff: pauses.append(backoff))
    assert len(pauses) == 12
    assert pauses[0] == FIRST_POLL_S and pauses[-1] == MAX_POLL_S
    assert all(b == min(a * 2, MAX_POLL_S) for a, b in itertools.pairwise(pauses))

    def give_up(elapsed: float) -> None:
        if elapsed > 0.05:
            raise CollectiveError("gave up")

    with pytest.raises(CollectiveError, match="gave up"):
        poll_until(lambda: False, give_up)
