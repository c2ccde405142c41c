"""Retention by complete step across shards, the storage progress a sidecar reports, and
durable directories: two shards, each with its own shared memory and real sidecar
threads, persisting into one storage directory."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import assert_state_is, make_state

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.checkpoint.records import SnapshotRecord, Topology
from bulkhead.trainer.checkpoint.restore import ANY_SHARD
from bulkhead.trainer.checkpoint.storage import INCOMPLETE_KEPT, FileStorage

SHARDS = ("a", "b")


class FailingSteps(FileStorage):
    """Real FileStorage whose writes of the steps in ``failing`` fail with EIO."""

    failing: set[int] = set()

    def persist(self, record: SnapshotRecord, data: memoryview) -> None:
        if record.step in FailingSteps.failing:
            raise OSError(errno.EIO, "Input/output error")
        super().persist(record, data)


def _engines(shm_factory, sidecar_factory, storage: Path, keep: int) -> dict[str, CheckpointEngine]:
    engines = {}
    for shard in SHARDS:
        shm = shm_factory()
        factory = FailingSteps if shard == "b" else FileStorage
        sidecar_factory(shm, storage_factory=factory)
        settings = CheckpointSettings(job="job1", shm_dir=shm, storage_dir=storage, keep=keep)
        engines[shard] = CheckpointEngine(settings, Topology(shard=shard, shards=SHARDS))
    return engines


def _snapshot_all(engines: dict[str, CheckpointEngine], step: int) -> dict[str, dict]:
    statuses = {}
    for shard, engine in engines.items():
        engine.snapshot(step, make_state(step))
        statuses[shard] = engine.flush(timeout=60)
    return statuses


@pytest.mark.parametrize("keep", [1, 3])
def test_one_shard_missing_writes_keeps_a_complete_step_and_reports_it(
    keep, shm_factory, sidecar_factory, tmp_path
) -> None:
    """Shard b fails to persist ``keep`` intervals in a row, then every pod is lost: the
    newest step both shards persisted is still on storage, is what both sidecars report,
    and is what a restore from empty memory finds."""
    engines = _engines(shm_factory, sidecar_factory, tmp_path, keep)
    FailingSteps.failing = {20, 30, 40}
    try:
        _snapshot_all(engines, 10)
        for step in (20, 30, 40)[:keep]:
            statuses = _snapshot_all(engines, step)
            assert statuses["a"]["persisted_step"] == 10, statuses  # the newest complete one
            assert statuses["b"]["persisted_step"] == 10 and "EIO" in statuses["b"]["last_error"]
    finally:
        FailingSteps.failing = set()
        for engine in engines.values():
            engine.close()
    storage = FileStorage(tmp_path)
    assert storage.newest_complete("job1") == 10
    incomplete = [s.step for s in storage.steps("job1") if not s.complete]
    assert incomplete == {1: [20], 3: [40, 30, 20]}[keep]  # a's, awaiting b (INCOMPLETE_KEPT)
    assert len(incomplete) <= INCOMPLETE_KEPT
    # Every pod lost: new memory, no peers; both shards come back from storage at step 10.
    for shard in SHARDS:
        settings = CheckpointSettings(job="job1", shm_dir=shm_factory(), storage_dir=tmp_path)
        with CheckpointEngine(settings, Topology(shard=shard, shards=SHARDS)) as engine:
            any_shard = engine.restore(shard=ANY_SHARD)
            mine = engine.restore()
        assert any_shard is not None and any_shard.step == 10
        assert mine is not None and (mine.step, mine.tier) == (10, "storage")
        assert_state_is(mine.state, 10)


def test_once_shards_meet_again_older_steps_go_and_the_newest_complete_stays(
    shm_factory, sidecar_factory, tmp_path
) -> None:
    engines = _engines(shm_factory, sidecar_factory, tmp_path, keep=1)
    FailingSteps.failing = {20}
    try:
        for step in (10, 20, 30):
            statuses = _snapshot_all(engines, step)
    finally:
        FailingSteps.failing = set()
        for engine in engines.values():
            engine.close()
    assert statuses["b"]["persisted_step"] == 30 and statuses["b"]["last_error"] is None
    storage = FileStorage(tmp_path)
    steps = storage.steps("job1")
    assert [(s.step, s.complete) for s in steps] == [(30, True)]  # 10 and a's 20 are gone
    assert sorted(p.name for p in (tmp_path / "job1").iterdir()) == ["step-000000000030"]


def test_a_corrupt_newer_step_taken_before_a_fall_back_is_retired_not_the_present(
    shm_factory, sidecar_factory, tmp_path
) -> None:
    """keep 1: after restoring step 10 (step 20 failed its CRC), the steps trained since
    are the present: retention keeps the newest taken, not the highest numbered."""
    engines = _engines(shm_factory, sidecar_factory, tmp_path, keep=1)
    try:
        _snapshot_all(engines, 20)
        _snapshot_all(engines, 10)  # the timeline after a fall back: step numbers go down
    finally:
        for engine in engines.values():
            engine.close()
    assert [(s.step, s.complete) for s in FileStorage(tmp_path).steps("job1")] == [(10, True)]


def test_new_step_directories_are_fsynced_in_their_parent_before_the_manifest(
    tmp_path,
) -> None:
    """strace of a real persist: each directory it creates is fsynced (opened and synced
    as the parent of the next entry) before the manifest's rename makes the step visible."""
    script = (
        "import sys; from pathlib import Path; "
        "from bulkhead.trainer.checkpoint.records import SnapshotRecord; "
        "from bulkhead.trainer.checkpoint.storage import FileStorage; "
        "import crc32c; data = b'x' * 4096; "
        "r = SnapshotRecord(job='job1', shard='a', step=7, shards=['a'], nbytes=len(data), "
        "tensors=[], skeleton='{}'); r.seal(crc32c.crc32c(data)); "
        "FileStorage(Path(sys.argv[1])).persist(r, memoryview(data))"
    )
    root = tmp_path / "root"
    trace = tmp_path / "trace"
    calls = "trace=mkdir,mkdirat,openat,fsync,rename,renameat,renameat2"
    command = [sys.executable, "-P", "-c", script, str(root)]
    subprocess.run(["strace", "-f", "-o", str(trace), "-e", calls, *command], check=True)
    lines = trace.read_text().splitlines()
    manifest = next(
        i for i, line in enumerate(lines) if "rename" in line and "a.manifest.json" in line
    )
    for made, parent in ((root / "job1", root), (root / "job1/step-000000000007", root / "job1")):
        mkdir = next(i for i, line in enumerate(lines) if "mkdir" in line and f'"{made}"' in line)
        opened = next(
            i
            for i in range(mkdir, len(lines))
            if f'"{parent}"' in lines[i] and "O_DIRECTORY" in lines[i]
        )
        fd = lines[opened].rsplit("=", 1)[1].strip()
        synced = next(i for i in range(opened, len(lines)) if f"fsync({fd})" in lines[i])
        assert synced < manifest, (made, lines[mkdir : manifest + 1])
