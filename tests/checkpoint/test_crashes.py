"""Real process deaths: the trainer killed mid-snapshot or after it, the sidecar mid-persist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import assert_state_is
from sidecar_process import spawn_sidecar
from tests_paths import HERE
from waiting import wait_until

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.checkpoint.storage import MANIFEST_SUFFIX, FileStorage

pytestmark = pytest.mark.slow


def start_trainer(shm_dir: Path, scale: int, storage: Path | None = None) -> subprocess.Popen:
    args = [sys.executable, str(HERE / "ckpt_trainer_child.py"), str(shm_dir), "job1", str(scale)]
    if storage is not None:
        args.append(str(storage))
    # A script run by path has its own folder, not the working directory, on sys.path.
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def read_steps(process: subprocess.Popen, count: int) -> int:
    last = 0
    for _ in range(count):
        line = process.stdout.readline()
        assert line, f"trainer exited early with {process.poll()}"
        last = int(line)
    return last


@pytest.mark.parametrize("snapshots_before_kill", [3, 8])
def test_killed_trainer_restarts_from_shared_memory(
    shm_dir, sidecar_factory, tmp_path, snapshots_before_kill
) -> None:
    """SIGKILL lands mid-snapshot or between: the restore is a whole snapshot, never torn."""
    sidecar_factory(shm_dir)
    trainer = start_trainer(shm_dir, scale=1024)  # ~16 MB, so a kill often lands in a copy
    try:
        last_reported = read_steps(trainer, snapshots_before_kill)
    finally:
        trainer.kill()
        trainer.wait()
    settings = CheckpointSettings(job="job1", shm_dir=shm_dir, storage_dir=tmp_path)
    with CheckpointEngine(settings) as engine:
        restored = engine.restore()
    assert restored is not None and restored.tier == "shm"
    assert restored.step >= last_reported  # the last reported snapshot (or a newer one)
    assert_state_is(restored.state, restored.step, scale=1024)
    assert not any(tmp_path.iterdir())  # storage was never needed


def test_sidecar_killed_mid_persist_leaves_nothing_visible(shm_dir, tmp_path) -> None:
    sidecar = spawn_sidecar(shm_dir, args=["--max-write-mbps", "20", "--poll-interval", "0.1"])
    settings = CheckpointSettings(job="job1", shm_dir=shm_dir, storage_dir=tmp_path)
    from ckpt_helpers import make_state

    engine = CheckpointEngine(settings)
    try:
        engine.snapshot(10, make_state(10, scale=512))
        assert engine.flush(timeout=60)["persisted_step"] == 10
        engine.snapshot(20, make_state(20, scale=4096))  # ~64 MB at 20 MB/s: ~3 s to write
        partial = wait_until(
            lambda: [p for p in tmp_path.rglob(".rank0-*.tmp") if p.stat().st_size > 0],
            what="the persist of step 20 to start",
        )
        sidecar.kill()
        assert partial[0].exists()  # really killed mid-write
        storage = FileStorage(tmp_path)
        assert [s for s, _ in storage.complete_steps("job1", "rank0")] == [10]
        assert not list((tmp_path / "job1" / "step-000000000020").glob(f"*{MANIFEST_SUFFIX}"))

        sidecar = spawn_sidecar(shm_dir, args=["--poll-interval", "0.1"])  # restarted container
        assert engine.flush(timeout=60)["persisted_step"] == 20  # resumes from shared memory
        assert [s for s, _ in storage.complete_steps("job1", "rank0")] == [20, 10]
        assert list(tmp_path.rglob("*.tmp")) == []
    finally:
        engine.close()
        sidecar.stop()
