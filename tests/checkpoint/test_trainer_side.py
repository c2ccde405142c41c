"""Snapshot into shared memory and restore from it, with an in-process sidecar."""

from __future__ import annotations

import crc32c
import pytest
import torch
from ckpt_helpers import assert_state_is, make_state
from pydantic import ValidationError
from waiting import wait_until

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings, Topology, checksum
from bulkhead.trainer.checkpoint.restore import ClobberedError
from bulkhead.trainer.checkpoint.shm import all_slots


def settings(shm_dir, **extra) -> CheckpointSettings:
    return CheckpointSettings(**{"job": "job1", "shm_dir": shm_dir, "seal_timeout_s": 30, **extra})


def test_snapshot_restore_roundtrip_from_shared_memory(shm_dir, sidecar_factory) -> None:
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        first = engine.snapshot(10, make_state(10))
        second = engine.snapshot(20, make_state(20))
        assert {first.slot, second.slot} == {0, 1}  # double buffering
        assert first.nbytes > 0 and first.blocking_s >= 0
        restored = engine.restore()
    assert restored is not None
    assert (restored.step, restored.tier) == (20, "shm")
    assert_state_is(restored.state, 20)


def test_restore_into_live_tensors_and_max_step(shm_dir, sidecar_factory) -> None:
    sidecar_factory(shm_dir)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    with CheckpointEngine(settings(shm_dir)) as engine:
        engine.snapshot(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        engine.snapshot(2, {"model": {k: v + 1 for k, v in saved.items()}})
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        live = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        restored = engine.restore(into=live, max_step=1)
    assert restored is not None and restored.step == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key  # filled in place into the parameters
    optimizer.load_state_dict(restored.state["optim"])


def test_parallel_copy_seal_and_verify_agree_with_a_serial_crc(
    shm_dir, sidecar_factory, monkeypatch
) -> None:
    """Several copy threads and CRC pieces per snapshot: the sealed CRC is the plain CRC-32C
    of the bytes, and restore verifies and copies them back exactly."""
    monkeypatch.setattr(checksum, "MIN_PIECE_BYTES", 4096)
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir, copy_threads=3)) as engine:
        result = engine.snapshot(8, make_state(8, scale=16))
        assert len(checksum.split_spans(result.nbytes, 3)) > 4
        wait_until(lambda: engine.status()["sealed_step"] == 8, what="seal of step 8")
        files = all_slots(shm_dir)[result.slot]
        assert files.record().crc32c == crc32c.crc32c(files.data.read_bytes()[: result.nbytes])
        live = make_state(0, scale=16)
        restored = engine.restore(into=live)
    assert restored is not None and restored.step == 8
    assert restored.state["model"]["embed.weight"] is live["model"]["embed.weight"]
    assert_state_is(restored.state, 8, scale=16)


def test_copy_threads_setting() -> None:
    assert CheckpointSettings(job="j").copy_threads >= 1
    assert CheckpointSettings(job="j", copy_threads=1).copy_threads == 1
    with pytest.raises(ValidationError):
        CheckpointSettings(job="j", copy_threads=0)


def flip_byte(shm_dir, slot: int, offset: int) -> None:
    with open(all_slots(shm_dir)[slot].data, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x01]))


def wait_sealed(engine: CheckpointEngine, shm_dir, step: int) -> None:
    """Until the sidecar has sealed ``step`` and every other snapshot in memory."""
    wait_until(lambda: engine.status()["sealed_step"] == step, what=f"seal of step {step}")

    def all_sealed() -> bool:
        records = [files.record() for files in all_slots(shm_dir)]
        return all(record is None or record.crc32c is not None for record in records)

    wait_until(all_sealed, what="seals")


def test_corrupt_shared_memory_falls_back_to_older_snapshot(shm_dir, sidecar_factory) -> None:
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        engine.snapshot(10, make_state(10))
        newest = engine.snapshot(20, make_state(20))
        wait_sealed(engine, shm_dir, 20)
        flip_byte(shm_dir, newest.slot, 100)  # one bit flipped in the newest snapshot
        restored = engine.restore()
    assert restored is not None
    assert (restored.step, restored.tier) == (10, "shm")
    assert any("step 20" in s and "CRC" in s for s in restored.skipped)
    assert_state_is(restored.state, 10)


def test_other_shards_and_jobs_are_never_restored(shm_dir, sidecar_factory) -> None:
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir), Topology(shard="a", shards=("a",))) as engine:
        engine.snapshot(5, make_state(5))
        engine.set_topology(Topology(shard="b", shards=("b",)))
        assert engine.restore() is None
    with CheckpointEngine(settings(shm_dir).model_copy(update={"job": "other"})) as engine:
        assert engine.restore() is None


def test_without_a_sidecar_snapshots_still_work_but_are_unverified(shm_dir) -> None:
    with CheckpointEngine(settings(shm_dir, seal_timeout_s=0)) as engine:
        result = engine.snapshot(3, make_state(3))
        assert result.nbytes > 0
        assert engine.restore() is None  # never load what nobody has sealed


def test_interrupted_copy_leaves_the_previous_snapshot(shm_dir, sidecar_factory) -> None:
    """A copy that dies midway (here: a tensor that cannot be read) publishes nothing."""
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        engine.snapshot(10, make_state(10))
        engine.snapshot(20, make_state(20))
        # The sidecar done with both (sealed): the next snapshot takes the older slot.
        # (While it still holds the older one, the newest is the one overwritten.)
        engine.flush(timeout=60)
        broken = make_state(30)
        broken["zz_unreadable"] = torch.empty(1024, device="meta")  # copied last, raises
        with pytest.raises(NotImplementedError):
            engine.snapshot(30, broken)
        restored = engine.restore()
    assert restored is not None and restored.step == 20
    assert_state_is(restored.state, 20)


def test_after_falling_back_the_abandoned_newer_snapshot_never_wins(
    shm_dir, sidecar_factory
) -> None:
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        engine.snapshot(10, make_state(10))
        engine.snapshot(20, make_state(20))
        restored = engine.restore(max_step=10)  # e.g. the ranks agreed on step 10
        assert restored is not None and restored.step == 10
        engine.snapshot(15, make_state(15))
    with CheckpointEngine(settings(shm_dir)) as engine:  # the trainer restarts again
        restored = engine.restore()
    assert restored is not None and restored.step == 15
    assert_state_is(restored.state, 15)


def test_settings_from_the_job_spec(shm_dir) -> None:
    from bulkhead.api.spec import CheckpointConfig

    config = CheckpointConfig.model_validate(
        {"intervalSteps": 25, "keep": 4, "storage": {"path": "/data/ckpt"}}
    )
    made = CheckpointSettings.from_spec(config, job="job1", shm_dir=shm_dir)
    assert (made.interval_steps, made.keep, str(made.storage_dir)) == (25, 4, "/data/ckpt")
    assert made.socket_path == shm_dir / "checkpointd.sock"
    engine = CheckpointEngine(made)
    assert [engine.due(step) for step in (0, 24, 25, 50)] == [False, False, True, True]
    engine.close()
    on_pvc = CheckpointSettings.from_spec(
        CheckpointConfig.model_validate({"storage": {"pvc": "ckpt"}}), job="job1"
    )
    assert str(on_pvc.storage_dir) == "/bulkhead/checkpoints"  # where the operator mounts the claim


def test_corrupt_snapshot_restored_into_live_tensors_is_overwritten_by_the_older_one(
    shm_dir, sidecar_factory, monkeypatch
) -> None:
    """Verified while copied: the bad bytes reach the caller's tensors, the check fails, the
    older snapshot (same layout) fills every one of them again, and nothing is reported
    clobbered."""
    monkeypatch.setattr(checksum, "MIN_PIECE_BYTES", 4096)  # several ranges on two threads
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        engine.snapshot(10, make_state(10, scale=16))
        newest = engine.snapshot(20, make_state(20, scale=16))
        wait_sealed(engine, shm_dir, 20)
        flip_byte(shm_dir, newest.slot, 100)  # inside the first tensor's bytes
        live = make_state(0, scale=16)
        restored = engine.restore(into=live)
    assert restored is not None and (restored.step, restored.tier) == (10, "shm")
    assert any("step 20" in s and "CRC" in s for s in restored.skipped)
    assert restored.clobbered == []
    assert restored.state["model"]["embed.weight"] is live["model"]["embed.weight"]
    assert_state_is(restored.state, 10, scale=16)


def test_tensors_a_corrupt_snapshot_wrote_and_the_older_one_does_not_fill_are_named(
    shm_dir, sidecar_factory
) -> None:
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        engine.snapshot(10, make_state(10))  # embed and exp_avg are 64 x 32 here
        newest = engine.snapshot(20, make_state(20, scale=2))  # ... and 128 x 32 here
        wait_sealed(engine, shm_dir, 20)
        flip_byte(shm_dir, newest.slot, 100)
        live = make_state(0, scale=2)
        restored = engine.restore(into=live)
    assert restored is not None and restored.step == 10
    assert restored.clobbered == ["model/embed.weight", "optimizer/state/0/exp_avg"]
    assert_state_is(restored.state, 10)  # the state returned is whole and right
    assert restored.state["model"]["embed.weight"] is not live["model"]["embed.weight"]
    # The same-shaped tensors were filled again in place.
    assert restored.state["model"]["head.bias"] is live["model"]["head.bias"]


def test_no_good_snapshot_after_one_wrote_into_live_tensors_raises(
    shm_dir, sidecar_factory
) -> None:
    sidecar_factory(shm_dir)
    with CheckpointEngine(settings(shm_dir)) as engine:
        only = engine.snapshot(20, make_state(20))
        wait_sealed(engine, shm_dir, 20)
        flip_byte(shm_dir, only.slot, 100)
        live = make_state(0)
        with pytest.raises(ClobberedError, match=r"model/embed\.weight"):
            engine.restore(into=live)
        # Into fresh tensors a corrupt snapshot leaves no trace: plainly nothing to restore.
        assert engine.restore() is None
