"""Flattening states into a buffer and back: dtypes, odd shapes, nesting, in-place restore."""

from __future__ import annotations

import math

import crc32c
import pytest
import torch
from ckpt_helpers import assert_state_is, make_state

from bulkhead.trainer.checkpoint import checksum
from bulkhead.trainer.checkpoint.checksum import Workers, split_spans
from bulkhead.trainer.checkpoint.flatten import (
    ALIGN,
    SkeletonError,
    assemble,
    assemble_verified,
    copy_into,
    plan_layout,
)
from bulkhead.trainer.checkpoint.records import SnapshotRecord


class Position:
    """A user object: a state holds data only, so it is refused (nothing is pickled)."""

    def __init__(self, offsets: torch.Tensor) -> None:
        self.offsets = offsets


def record_of(layout) -> SnapshotRecord:
    return SnapshotRecord(
        job="j",
        shard="s",
        step=1,
        shards=["s"],
        nbytes=layout.nbytes,
        tensors=layout.entries,
        skeleton=layout.skeleton,
    )


def roundtrip(state, into=None, copy=True):
    layout = plan_layout(state)
    buffer = torch.zeros(layout.nbytes + 1, dtype=torch.uint8)
    copy_into(layout, buffer)
    return layout, assemble(record_of(layout), buffer, into, copy)


def test_roundtrip_keeps_values_dtypes_and_structure() -> None:
    _, restored = roundtrip(make_state(7))
    assert_state_is(restored, 7)


def test_odd_tensors_survive() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "transposed": base.t(),  # non-contiguous
        "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "complex": torch.tensor([1 + 2j]),
        "tuple": (torch.ones(2), "text", 3),
        "numbers": {0: float("nan"), 1: float("-inf"), "ok": True, "none": None},
    }
    layout, restored = roundtrip(state)
    assert all(entry.offset % ALIGN == 0 for entry in layout.entries)
    assert restored["scalar"].item() == 3 and restored["scalar"].dtype == torch.int64
    assert restored["empty"].shape == (0, 5)
    assert torch.equal(restored["transposed"], base.t())
    assert torch.equal(restored["half"], state["half"])
    assert torch.equal(restored["complex"], state["complex"])
    assert restored["tuple"][1:] == ("text", 3)
    numbers = restored["numbers"]
    assert math.isnan(numbers[0]) and numbers[1] == float("-inf")
    assert (numbers["ok"], numbers["none"]) == (True, None)


def test_a_state_is_data_only() -> None:
    with pytest.raises(TypeError, match="cannot snapshot a Position"):
        plan_layout({"position": Position(torch.tensor([9, 8, 7]))})
    with pytest.raises(TypeError, match="keys must be str or int"):
        plan_layout({"bad": {(1, 2): torch.ones(1)}})


@pytest.mark.parametrize(
    "skeleton",
    [
        "gASVIAAAAAAAAACMCGJ1aWx0aW5zlIwFcHJpbnSUk5SMBWhlbGxvlIWUUpQu",  # a pickle payload
        '{"$d": [["w", {"$t": 99}]]}',  # a tensor reference out of range
        '{"$x": 1}',  # an unknown tag
        "[1, 2]",  # not a state dict
        '{"$d": [[["k"], 1]]}',  # a key that is not str or int
    ],
)
def test_a_tampered_skeleton_is_refused_before_any_byte_is_copied(skeleton: str) -> None:
    layout = plan_layout({"w": torch.ones(4)})
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copy_into(layout, buffer)
    record = record_of(layout).model_copy(update={"skeleton": skeleton})
    target = {"w": torch.zeros(4)}
    with pytest.raises(SkeletonError):
        assemble(record, buffer, into=target)
    with pytest.raises(SkeletonError):
        assemble_verified(record, buffer, into=target)
    assert torch.equal(target["w"], torch.zeros(4))  # untouched


def test_restore_into_fills_matching_tensors_in_place() -> None:
    target = make_state(0)
    embed = target["model"]["embed.weight"]
    target["model"]["head.bias"] = torch.zeros(3)  # shape differs: must not be filled
    _, restored = roundtrip(make_state(5), into=target)
    assert restored["model"]["embed.weight"] is embed
    assert torch.equal(embed, torch.full_like(embed, 5.0))
    assert restored["model"]["head.bias"].shape == (7,)
    assert torch.equal(target["model"]["head.bias"], torch.zeros(3))


def test_copies_do_not_alias_the_buffer() -> None:
    layout = plan_layout({"w": torch.ones(4)})
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copy_into(layout, buffer)
    restored = assemble(record_of(layout), buffer, copy=True)
    buffer.zero_()
    assert torch.equal(restored["w"], torch.ones(4))


def test_unsupported_state_is_rejected_clearly() -> None:
    with pytest.raises(TypeError, match="sparse"):
        plan_layout({"w": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="must be a dict"):
        plan_layout([torch.ones(1)])  # type: ignore[arg-type]


def mixed_state() -> dict:
    """Big tensors that span several pieces, and every kind that must not be sliced flat."""
    grid = torch.arange(40 * 30, dtype=torch.float32).reshape(40, 30)
    return {
        "big": torch.arange(5000, dtype=torch.float64),
        "bf16": torch.linspace(-3, 3, 3001).to(torch.bfloat16),
        "transposed": grid.t(),  # non-contiguous: copied whole
        "every_other": torch.arange(999, dtype=torch.int16)[::2],
        "complex": torch.randn(333, dtype=torch.complex64),
        "mask": torch.arange(777) % 3 == 0,
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }


def test_parallel_copy_writes_the_same_bytes_as_the_serial_one(monkeypatch) -> None:
    monkeypatch.setattr(checksum, "MIN_PIECE_BYTES", 256)  # pieces cut through tensors
    state = mixed_state()
    layout = plan_layout(state)
    assert len(split_spans(layout.nbytes, 3)) > len(state)
    serial = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copy_into(layout, serial)
    parallel = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)  # padding differs
    workers = Workers(3)
    try:
        copy_into(layout, parallel, workers)
        into = {key: torch.zeros_like(value) for key, value in state.items()}
        assert not into["transposed"].is_contiguous()  # such a target is filled whole
        restored = assemble(record_of(layout), parallel, into, copy=True, workers=workers)
        fresh = assemble(record_of(layout), parallel, copy=True, workers=workers)
    finally:
        workers.close()
    for entry in layout.entries:
        span = slice(entry.offset, entry.offset + entry.nbytes)
        assert torch.equal(parallel[span], serial[span]), entry.path
    parallel.zero_()  # fresh tensors must not alias the buffer
    for key, value in state.items():
        assert torch.equal(restored[key], value), key
        assert restored[key] is into[key], key
        assert torch.equal(fresh[key], value), key


def test_a_failing_piece_fails_the_parallel_copy(monkeypatch) -> None:
    monkeypatch.setattr(checksum, "MIN_PIECE_BYTES", 256)
    layout = plan_layout({"ok": torch.ones(4096), "unreadable": torch.empty(4096, device="meta")})
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    workers = Workers(2)
    try:
        with pytest.raises(NotImplementedError):
            copy_into(layout, buffer, workers)
    finally:
        workers.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_verified_copy_equals_the_plain_one_and_checksums_every_byte(monkeypatch, threads) -> None:
    """Small chunks and ranges cut through tensors: the same state as ``assemble``, filled in
    place where ``into`` matches, and the CRC of the whole buffer, padding included."""
    monkeypatch.setattr(checksum, "MIN_PIECE_BYTES", 256)
    state = mixed_state()
    layout = plan_layout(state)
    buffer = torch.full((layout.nbytes + 64,), 0x5A, dtype=torch.uint8)  # padding not zero
    copy_into(layout, buffer)
    into = {key: torch.zeros_like(value) for key, value in state.items()}
    into["bf16"] = torch.zeros(7, dtype=torch.bfloat16)  # other shape: comes back fresh
    workers = Workers(threads)
    try:
        copied = assemble_verified(record_of(layout), buffer, into, workers, chunk_bytes=192)
        fresh = assemble_verified(record_of(layout), buffer, None, workers, chunk_bytes=192)
    finally:
        workers.close()
    expected = crc32c.crc32c(buffer[: layout.nbytes].numpy())
    assert copied.crc32c == fresh.crc32c == expected
    restored = copied.state()
    buffer.zero_()  # nothing aliases the buffer
    for key, value in state.items():
        assert torch.equal(restored[key], value), key
        assert torch.equal(fresh.state()[key], value), key
    assert restored["big"] is into["big"] and restored["transposed"] is into["transposed"]
    assert restored["bf16"] is not into["bf16"]
    assert sorted(copied.in_place) == sorted((key,) for key in state if key != "bf16")
    assert fresh.in_place == []


def test_verified_copy_reports_a_corrupt_buffer_through_its_crc() -> None:
    layout = plan_layout(make_state(3))
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copy_into(layout, buffer)
    good = crc32c.crc32c(buffer.numpy())
    buffer[layout.nbytes // 2] ^= 0x10
    copied = assemble_verified(record_of(layout), buffer)
    assert copied.crc32c != good
    with pytest.raises(ValueError, match="cannot hold"):
        assemble_verified(record_of(layout), buffer[:10])
