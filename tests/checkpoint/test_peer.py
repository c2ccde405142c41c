"""Peer replicas between two real sidecar processes over TCP on 127.0.0.1."""

from __future__ import annotations

import socket

import httpx
import pytest
from ckpt_helpers import assert_state_is, make_state
from sidecar_process import spawn_sidecar

from bulkhead.api.protocol import TOKEN_ENV
from bulkhead.trainer.checkpoint import (
    CheckpointEngine,
    CheckpointSettings,
    Topology,
)
from bulkhead.trainer.checkpoint.replica import ReplicaError, list_replicas

pytestmark = pytest.mark.slow
TOKEN = "s3cret-job-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_replica_port_never_serves_without_a_token(shm_factory) -> None:
    from bulkhead.trainer.checkpoint.replica import ReplicaError, ReplicaServer, ReplicaStore

    with pytest.raises(ReplicaError, match="needs the job's token"):
        ReplicaServer("127.0.0.1:0", ReplicaStore(shm_factory()), token=None)


def test_restore_prefers_peer_replica_then_falls_back_to_storage(shm_factory, tmp_path) -> None:
    env = {TOKEN_ENV: TOKEN}
    node_a, node_b = shm_factory(), shm_factory()
    peer = spawn_sidecar(node_b, listen="127.0.0.1:0", env=env, args=["--poll-interval", "0.1"])
    metrics_port = free_port()
    own_args = ["--poll-interval", "0.1", "--metrics-port", str(metrics_port)]
    own = spawn_sidecar(
        node_a, listen="127.0.0.1:0", env=env, args=[*own_args, "--metrics-host", "127.0.0.1"]
    )
    settings = CheckpointSettings(job="job1", shm_dir=node_a, storage_dir=tmp_path, token=TOKEN)
    try:
        with CheckpointEngine(settings) as engine:
            engine.set_topology(Topology(replicate_to=peer.replica_address))
            engine.snapshot(10, make_state(10))
            status = engine.flush(timeout=60)
            assert (status["replicated_step"], status["persisted_step"]) == (10, 10)
            scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            assert 'bulkhead_checkpoint_last_step{tier="storage"} 10.0' in scraped
            assert "bulkhead_checkpoint_persist_seconds_count 1.0" in scraped
            # Step 20 reaches the peer but not storage (as if storage were slow or down).
            engine.set_topology(Topology(replicate_to=peer.replica_address, persist=False))
            engine.snapshot(20, make_state(20))
            assert engine.flush(timeout=60)["replicated_step"] == 20
        with pytest.raises(ReplicaError, match="unauthorized"):
            list_replicas(peer.replica_address, "job1", token="wrong", timeout=10)

        own.kill()  # the node is lost: its sidecar and its memory
        fresh = shm_factory()
        own = spawn_sidecar(fresh, listen="127.0.0.1:0", env=env, args=["--poll-interval", "0.1"])
        settings = settings.model_copy(update={"shm_dir": fresh})
        topology = Topology(peers=(peer.replica_address,))
        with CheckpointEngine(settings, topology) as engine:
            restored = engine.restore()
            assert restored is not None and (restored.step, restored.tier) == (20, "peer")
            assert_state_is(restored.state, 20)

            peer.kill()  # the peer is gone too: only storage is left
            restored = engine.restore()
            assert restored is not None and (restored.step, restored.tier) == (10, "storage")
            assert_state_is(restored.state, 10)
    finally:
        own.stop()
        peer.stop()
