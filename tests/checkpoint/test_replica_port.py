"""The sidecar's replica port under abuse: tokenless giant lines, idle connection floods.

A real sidecar process (its memory and threads read from /proc) and a real in-process
ReplicaServer with short deadlines for the idle-connection case.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
from pathlib import Path

import crc32c
import pytest
from sidecar_process import spawn_sidecar
from waiting import wait_until

from bulkhead.api.protocol import REPLICA_TOKEN_ENV, TOKEN_ENV
from bulkhead.api.spec import CheckpointConfig
from bulkhead.trainer.checkpoint import CheckpointSettings
from bulkhead.trainer.checkpoint.records import SnapshotRecord
from bulkhead.trainer.checkpoint.replica import (
    MAX_CONNECTIONS,
    ReplicaError,
    ReplicaServer,
    ReplicaStore,
    list_replicas,
    push_replica,
)
from bulkhead.trainer.checkpoint.wire import parse_address

TOKEN = "s3cret-job-token"
LINE_BYTES = 60 << 20  # the audit's probe: six 60 MiB tokenless lines


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _send_giant_line(address: tuple[str, int]) -> int:
    """Send up to LINE_BYTES of one tokenless line; returns how many bytes got out before
    the server closed the connection."""
    chunk = b"x" * (1 << 20)
    sent = 0
    # A reset or a broken pipe (suppressed) is the server hanging up.
    with socket.create_connection(address, timeout=30) as sock, contextlib.suppress(OSError):
        while sent < LINE_BYTES:
            sock.sendall(chunk)
            sent += len(chunk)
    return sent


@pytest.fixture
def low_fd_limit():
    """The audit's condition: a 1,024 open-file limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_tokenless_giant_lines_and_idle_floods_leave_the_sidecar_small_and_serving(
    shm_factory, low_fd_limit
) -> None:
    sidecar = spawn_sidecar(shm_factory(), listen="127.0.0.1:0", env={TOKEN_ENV: TOKEN})
    try:
        address = parse_address(sidecar.replica_address)
        peak_before = _proc_status(sidecar.pid, "VmHWM")  # kB
        threads_before = _proc_status(sidecar.pid, "Threads")
        sent = [_send_giant_line(address) for _ in range(6)]
        # The token line is read first and is at most 4 KiB: nothing like 60 MiB is taken in
        # (what got out sat in socket buffers, not in the sidecar's heap).
        assert all(n < LINE_BYTES for n in sent), sent
        grown_kb = _proc_status(sidecar.pid, "VmHWM") - peak_before
        assert grown_kb < 16 << 10, f"peak RSS grew by {grown_kb} kB"
        # 500 silent connections: at most MAX_CONNECTIONS are served (a handler and its
        # deadline timer each), the rest are closed at once.
        silent = [socket.create_connection(address, timeout=30) for _ in range(500)]
        try:
            wait_until(
                lambda: sum(_closed_by_server(s) for s in silent) >= 500 - MAX_CONNECTIONS,
                "the connections beyond the cap closed by the sidecar",
            )
            threads = _proc_status(sidecar.pid, "Threads")
            assert threads <= threads_before + 2 * MAX_CONNECTIONS + 2, threads
        finally:
            for sock in silent:
                sock.close()
        # Once the flood is gone, peers are served again.
        wait_until(
            lambda: list_replicas(sidecar.replica_address, "job1", TOKEN, timeout=10) == [],
            "a peer's list served after the flood",
            retry_errors=True,
        )
    finally:
        sidecar.stop()


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def test_a_connection_that_shows_no_token_in_time_is_closed(shm_factory) -> None:
    server = ReplicaServer(
        "127.0.0.1:0", ReplicaStore(shm_factory()), TOKEN, max_connections=4, auth_timeout=0.5
    )
    with server:
        thread = _serve(server)
        address = parse_address(server.address)
        idle = [socket.create_connection(address, timeout=30) for _ in range(4)]
        trickle = socket.create_connection(address, timeout=30)
        trickle.sendall(b'{"tok')  # a slow client, never finishing its line
        try:
            # All five are cut: four by the deadline, the trickler beyond the cap at once
            # or by the deadline; then the port serves again.
            wait_until(lambda: all(_closed_by_server(s) for s in [*idle, trickle]), "cut")
            assert list_replicas(server.address, "job1", TOKEN, timeout=10) == []
        finally:
            for sock in [*idle, trickle]:
                sock.close()
            server.shutdown()
            thread.join(10)


def _serve(server: ReplicaServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    return thread


def _sealed(shard: str, shards: list[str], step: int, data: bytes) -> SnapshotRecord:
    record = SnapshotRecord(
        job="job1",
        shard=shard,
        step=step,
        shards=shards,
        nbytes=len(data),
        tensors=[],
        skeleton="{}",
        created=float(step),
    )
    record.seal(crc32c.crc32c(data))
    return record


def test_replicas_of_superseded_layouts_leave_shared_memory(shm_factory) -> None:
    """Three reconfigurations push shards of three layouts: the oldest layout's replica is
    dropped (its file too), the newest two stay and are listed."""
    shm = shm_factory()
    server = ReplicaServer("127.0.0.1:0", ReplicaStore(shm), TOKEN)
    with server:
        thread = _serve(server)
        data = b"y" * 8192
        layouts = [(["a", "b"], "a"), (["x", "y", "z"], "x"), (["p", "q"], "p")]
        try:
            for step, (shards, shard) in enumerate(layouts, start=1):
                record = _sealed(shard, shards, step * 10, data)
                assert push_replica(server.address, record, memoryview(data), TOKEN, 10)
            held = list_replicas(server.address, "job1", TOKEN, timeout=10)
        finally:
            server.shutdown()
            thread.join(10)
    assert sorted((r.shard, r.step) for r in held) == [("p", 30), ("x", 20)]
    files = sorted(
        p.name.split("--")[1].removesuffix(".json") for p in (shm / "replicas").iterdir()
    )
    assert files == ["p", "p", "x", "x"]  # each its record and its bytes; nothing of "a"


def test_a_peer_advertising_a_huge_snapshot_is_skipped_and_storage_restores(
    shm_factory, sidecar_factory, tmp_path
) -> None:
    """A real peer sidecar lists a (sealed, self-consistent) replica of 1 PiB: the restore
    skips it, counted as corrupt, instead of dying allocating it, and falls back."""
    from ckpt_helpers import assert_state_is, make_state

    from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings, Topology
    from bulkhead.trainer.checkpoint.metrics import CORRUPT
    from bulkhead.trainer.checkpoint.records import TensorEntry, write_json_atomic

    peer_shm = shm_factory()
    peer = sidecar_factory(peer_shm, listen="127.0.0.1:0", token=TOKEN)
    huge = 1 << 50
    forged = SnapshotRecord(
        job="job1",
        shard="rank0",
        step=99,
        shards=["rank0"],
        nbytes=huge,
        tensors=[TensorEntry(path=["w"], dtype="uint8", shape=[huge], offset=0, nbytes=huge)],
        skeleton='{"__dict__":[["w",{"__tensor__":0}]]}',
        created=1e12,
    )
    forged.seal(0)
    write_json_atomic(
        peer_shm / "replicas" / "job1--rank0.json", forged.model_dump(mode="json"), durable=False
    )
    assert [r.step for r in list_replicas(peer.replica_address, "job1", TOKEN, 10)] == [99]

    own_shm = shm_factory()
    sidecar_factory(own_shm)
    settings = CheckpointSettings(job="job1", shm_dir=own_shm, storage_dir=tmp_path, token=TOKEN)
    with CheckpointEngine(settings) as engine:
        engine.snapshot(10, make_state(10))
        assert engine.flush(timeout=60)["persisted_step"] == 10
    skipped_before = CORRUPT.labels(tier="peer")._value.get()
    settings = settings.model_copy(update={"shm_dir": shm_factory()})  # memory lost
    sidecar_factory(settings.shm_dir)
    with CheckpointEngine(settings, Topology(peers=(peer.replica_address,))) as engine:
        restored = engine.restore()
    assert restored is not None and (restored.step, restored.tier) == (10, "storage")
    assert_state_is(restored.state, 10)
    assert CORRUPT.labels(tier="peer")._value.get() == skipped_before + 1


def test_sidecars_of_pods_started_before_and_after_a_token_rotation_accept_each_other(
    shm_factory,
) -> None:
    """A job token rotated mid-job reaches new pods only. Their sidecars and trainers (real
    sidecar processes; the trainer's token as CheckpointSettings reads it from the launch
    environment the operator gives) use the job's replica token, which a rotation keeps:
    old and new pods push and list each other's replicas. The job token alone, old or new,
    opens no replica port."""
    replica = "r3plica-token"
    old_env = {TOKEN_ENV: "job-token-before", REPLICA_TOKEN_ENV: replica}
    new_env = {TOKEN_ENV: "job-token-after", REPLICA_TOKEN_ENV: replica}
    old = spawn_sidecar(shm_factory(), listen="127.0.0.1:0", env=old_env)
    new = spawn_sidecar(shm_factory(), listen="127.0.0.1:0", env=new_env)
    try:
        data = b"z" * 4096
        for env, peer, shard in ((old_env, new, "a"), (new_env, old, "b")):
            token = CheckpointSettings.from_spec(CheckpointConfig(), "job1", env).token
            record = _sealed(shard, ["a", "b"], 10, data)
            assert push_replica(peer.replica_address, record, memoryview(data), token, 10)
            held = list_replicas(peer.replica_address, "job1", token, timeout=10)
            assert [(r.shard, r.step) for r in held] == [(shard, 10)]
        for job_token in (old_env[TOKEN_ENV], new_env[TOKEN_ENV]):
            with pytest.raises(ReplicaError, match="unauthorized"):
                list_replicas(old.replica_address, "job1", job_token, timeout=10)
    finally:
        old.stop()
        new.stop()
