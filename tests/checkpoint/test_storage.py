"""Persisting to storage: manifests last, retention, checksums, and storage failures."""

from __future__ import annotations

import errno
import json

import pytest
from ckpt_helpers import assert_state_is, make_state
from waiting import wait_until

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.checkpoint.metrics import STORAGE_ERRORS
from bulkhead.trainer.checkpoint.storage import MANIFEST_SUFFIX, FileStorage


def engine_for(shm_dir, storage, **extra) -> CheckpointEngine:
    settings = CheckpointSettings(
        **{"job": "job1", "shm_dir": shm_dir, "storage_dir": storage, "keep": 2, **extra}
    )
    return CheckpointEngine(settings)


def snapshot_persisted(engine: CheckpointEngine, step: int) -> dict:
    engine.snapshot(step, make_state(step))
    status = engine.flush(timeout=60)
    assert status["ok"], status
    return status


def test_persist_writes_verified_shards_and_keeps_the_newest_k(
    shm_dir, sidecar_factory, tmp_path
) -> None:
    sidecar_factory(shm_dir)
    with engine_for(shm_dir, tmp_path) as engine:
        for step in (10, 20, 30):
            assert snapshot_persisted(engine, step)["persisted_step"] == step
    storage = FileStorage(tmp_path)
    assert [step for step, _ in storage.complete_steps("job1", "rank0")] == [30, 20]
    assert not (tmp_path / "job1" / "step-000000000010").exists()
    manifest = json.loads((storage.manifest_path("job1", 30, "rank0")).read_text())
    assert manifest["step"] == 30 and manifest["crc32c"] is not None and manifest["nbytes"] > 0
    assert list(tmp_path.rglob("*.tmp")) == []


def test_all_memory_gone_restores_from_storage(shm_factory, sidecar_factory, tmp_path) -> None:
    first = shm_factory()
    sidecar_factory(first)
    with engine_for(first, tmp_path) as engine:
        snapshot_persisted(engine, 40)
    fresh = shm_factory()  # a replacement pod on another node: empty memory, no peers
    sidecar_factory(fresh)
    with engine_for(fresh, tmp_path) as engine:
        restored = engine.restore()
    assert restored is not None and (restored.step, restored.tier) == (40, "storage")
    assert_state_is(restored.state, 40)


def test_flipped_byte_in_a_shard_is_detected_and_skipped(
    shm_factory, sidecar_factory, tmp_path
) -> None:
    first = shm_factory()
    sidecar_factory(first)
    with engine_for(first, tmp_path) as engine:
        snapshot_persisted(engine, 10)
        snapshot_persisted(engine, 20)
    (shard,) = (tmp_path / "job1" / "step-000000000020").glob("rank0-*.bin")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = shm_factory()
    sidecar_factory(fresh)
    with engine_for(fresh, tmp_path) as engine:
        restored = engine.restore()
    assert restored is not None and (restored.step, restored.tier) == (10, "storage")
    assert any("step 20" in note and "CRC-32C" in note for note in restored.skipped)
    assert_state_is(restored.state, 10)


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(
            lambda m: m["tensors"][0].update(offset=m["tensors"][0]["offset"] + 4), id="offset"
        ),
        pytest.param(
            lambda m: m.update(skeleton=m["skeleton"].replace("0", "1", 1)), id="skeleton"
        ),
        pytest.param(lambda m: m.update(step=m["step"] + 1), id="step"),
    ],
)
def test_an_altered_manifest_is_corrupt_and_the_previous_checkpoint_restores(
    tamper, shm_factory, sidecar_factory, tmp_path
) -> None:
    """The shard bytes are intact, only the manifest changed: a wrong offset would restore
    wrong weights and a changed skeleton wrong hyper-parameters, silently, without the
    record's own checksum."""
    first = shm_factory()
    sidecar_factory(first)
    with engine_for(first, tmp_path) as engine:
        snapshot_persisted(engine, 10)
        snapshot_persisted(engine, 20)
    path = FileStorage(tmp_path).manifest_path("job1", 20, "rank0")
    manifest = json.loads(path.read_text())
    tamper(manifest)
    path.write_text(json.dumps(manifest))
    fresh = shm_factory()
    sidecar_factory(fresh)
    with engine_for(fresh, tmp_path) as engine:
        restored = engine.restore()
    assert restored is not None and (restored.step, restored.tier) == (10, "storage")
    assert_state_is(restored.state, 10)


class FullDisk(FileStorage):
    """Real FileStorage whose writes hit ENOSPC while ``full`` is set."""

    full = False

    def write_chunk(self, fd: int, data: memoryview) -> None:
        if FullDisk.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().write_chunk(fd, data)


def test_disk_full_is_reported_training_continues_old_checkpoints_intact(
    shm_dir, sidecar_factory, tmp_path
) -> None:
    sidecar_factory(shm_dir, storage_factory=FullDisk)
    errors_before = STORAGE_ERRORS.labels(reason="ENOSPC")._value.get()
    with engine_for(shm_dir, tmp_path) as engine:
        snapshot_persisted(engine, 10)
        snapshot_persisted(engine, 20)
        FullDisk.full = True
        try:
            status = snapshot_persisted(engine, 30)
            assert status["persisted_step"] == 20
            assert "ENOSPC" in status["last_error"] and "training continues" in status["last_error"]
            assert STORAGE_ERRORS.labels(reason="ENOSPC")._value.get() == errors_before + 1
            assert engine.snapshot(40, make_state(40)).nbytes > 0  # training goes on
            assert engine.flush(timeout=60)["persisted_step"] == 20  # still full
        finally:
            FullDisk.full = False
        assert snapshot_persisted(engine, 50)["persisted_step"] == 50  # space is back
    storage = FileStorage(tmp_path)
    assert [step for step, _ in storage.complete_steps("job1", "rank0")] == [50, 20]
    assert list(tmp_path.rglob("*.tmp")) == []


def test_unwritable_storage_path_is_reported(shm_dir, sidecar_factory, tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the storage directory should be")
    sidecar_factory(shm_dir)
    with engine_for(shm_dir, blocker / "ckpt") as engine:
        status = snapshot_persisted(engine, 10)
        assert status["persisted_step"] is None
        assert "ENOTDIR" in status["last_error"] or "EEXIST" in status["last_error"]
        restored = engine.restore()  # the snapshot itself is fine in memory
    assert restored is not None and (restored.step, restored.tier) == (10, "shm")


def test_a_step_missing_a_shard_is_not_complete(tmp_path, shm_dir, sidecar_factory) -> None:
    from bulkhead.trainer.checkpoint import Topology

    sidecar_factory(shm_dir)
    two_shards = Topology(shard="zero0", shards=("zero0", "zero1"))
    with engine_for(shm_dir, tmp_path) as engine:
        engine.set_topology(two_shards)
        snapshot_persisted(engine, 10)
    wait_until(lambda: list(tmp_path.rglob(f"zero0{MANIFEST_SUFFIX}")), what="zero0 manifest")
    assert FileStorage(tmp_path).complete_steps("job1", "zero0") == []
