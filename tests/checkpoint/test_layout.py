"""Flattening states into a buffer and back: dtypes, odd shapes, nesting, in-place restore."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import assert_state_is, make_state

from bulkhead.trainer.checkpoint.layout import ALIGN, assemble, copy_into, plan_layout
from bulkhead.trainer.checkpoint.records import SnapshotRecord


class Position:
    """A user object holding a tensor (found through pickling, not the dict walk)."""

    def __init__(self, offsets: torch.Tensor) -> None:
        self.offsets = offsets


def roundtrip(state, into=None, copy=True):
    layout = plan_layout(state)
    buffer = torch.zeros(layout.nbytes + 1, dtype=torch.uint8)
    copy_into(layout, buffer)
    record = SnapshotRecord(
        job="j",
        shard="s",
        step=1,
        shards=["s"],
        nbytes=layout.nbytes,
        tensors=layout.entries,
        skeleton=layout.skeleton,
    )
    return layout, assemble(record, buffer, into, copy)


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
        "inside_object": Position(torch.tensor([9, 8, 7], dtype=torch.int32)),
        "tuple": (torch.ones(2), "text", 3),
    }
    layout, restored = roundtrip(state)
    assert all(entry.offset % ALIGN == 0 for entry in layout.entries)
    assert restored["scalar"].item() == 3 and restored["scalar"].dtype == torch.int64
    assert restored["empty"].shape == (0, 5)
    assert torch.equal(restored["transposed"], base.t())
    assert torch.equal(restored["half"], state["half"])
    assert torch.equal(restored["complex"], state["complex"])
    assert torch.equal(restored["inside_object"].offsets, state["inside_object"].offsets)
    assert restored["tuple"][1:] == ("text", 3)


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
    record = SnapshotRecord(
        job="j", shard="s", step=1, shards=["s"], nbytes=layout.nbytes,
        tensors=layout.entries, skeleton=layout.skeleton,
    )  # fmt: skip
    restored = assemble(record, buffer, copy=True)
    buffer.zero_()
    assert torch.equal(restored["w"], torch.ones(4))


def test_unsupported_state_is_rejected_clearly() -> None:
    with pytest.raises(TypeError, match="sparse"):
        plan_layout({"w": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="must be a dict"):
        plan_layout([torch.ones(1)])  # type: ignore[arg-type]
