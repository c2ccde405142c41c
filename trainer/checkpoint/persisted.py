"""A persisted checkpoint read outside training: the whole parameters of one complete step.

Whatever the parallelism that wrote it, a step directory holds one file per checkpoint
shard, each the ``HeldState`` snapshot of one holder: ``{"holding": [step, shards,
index], "keys": {"param/<name>": flat tensor, ...}}``. A key is either whole (data
parallel, an expert a rank hosts, a pipeline stage's replicated parameter) or the rows a
sharded layout gave that holder (ZeRO, a stage sharded over its pod's processes), cut as
``bulkhead.trainer.parallel.layout.shard_range`` cuts them. Every shard's bytes are checked
against their CRC-32C before any is used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bulkhead.trainer.checkpoint.flatten import assemble
from bulkhead.trainer.checkpoint.records import SnapshotRecord
from bulkhead.trainer.checkpoint.storage import ChecksumMismatch, FileStorage
from bulkhead.trainer.parallel.layout import KeySpec, shard_range

PARAM = "param/"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointReadError(ValueError):
    """A persisted checkpoint that cannot be read (names the directory or the shard)."""


@dataclass(frozen=True)
class PersistedStep:
    """One complete step of a job's persisted checkpoints."""

    storage: FileStorage
    job: str
    step: int
    records: dict[str, SnapshotRecord]  # shard -> its manifest

    @property
    def plan(self) -> dict[str, Any]:
        return next(iter(self.records.values())).plan

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())


def locate(path: str | Path, step: int | None = None) -> PersistedStep:
    """The newest complete step (or ``step``) under ``path``: a job's checkpoint directory
    (``<root>/<job>``) or one of its ``step-<n>`` directories."""
    path = Path(path)
    match = _STEP_DIR.match(path.name)
    if match is not None:
        if step is not None and step != int(match.group(1)):
            raise CheckpointReadError(f"{path} is step {int(match.group(1))}, not step {step}")
        step, path = int(match.group(1)), path.parent
    if not path.is_dir():
        raise CheckpointReadError(f"{path}: no such checkpoint directory")
    storage = FileStorage(path.parent)
    manifests = storage.manifests(path.name)
    if not manifests:
        raise CheckpointReadError(f"{path}: no persisted checkpoint (no step-*/*.manifest.json)")
    notes = []
    for candidate in sorted(manifests, reverse=True):
        if step is not None and candidate != step:
            continue
        records = manifests[candidate]
        listed = {s for r in records.values() for s in r.shards}
        missing = sorted(listed - set(records))
        if not missing:
            return PersistedStep(storage, path.name, candidate, records)
        notes.append(f"step {candidate} lacks shard(s) {', '.join(missing[:4])}")
    if step is not None and step not in manifests:
        raise CheckpointReadError(f"{path}: no step {step}; steps: {sorted(manifests)}")
    raise CheckpointReadError(f"{path}: no complete step ({'; '.join(notes)})")


def persisted_params(
    persisted: PersistedStep,
    shapes: dict[str, torch.Size],
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter of ``shapes`` (name -> shape), assembled from the step's shards.
    ``progress(nbytes)`` is called after each shard is read."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in shapes}
    for shard, record in sorted(persisted.records.items()):
        buffer = torch.empty(record.nbytes, dtype=torch.uint8)
        where = persisted.storage.step_dir(persisted.job, persisted.step)
        try:
            persisted.storage.read_into(record, memoryview(buffer.numpy()))
        except (ChecksumMismatch, OSError) as exc:
            raise CheckpointReadError(f"{where}: shard {shard}: {exc}") from None
        state = assemble(record, buffer, copy=False)
        _, shards, index = (int(v) for v in state["holding"])
        for key, tensor in state["keys"].items():
            if not key.startswith(PARAM) or not tensor.numel():
                continue
            name = key.removeprefix(PARAM)
            if name not in shapes:
                raise CheckpointReadError(
                    f"{where}: shard {shard} holds {name!r}, which the model does not have "
                    "(another family or sizes?)"
                )
            shape = shapes[name]
            numel = math.prod(shape)
            if tensor.numel() == numel:
                start, stop = 0, numel
            else:
                spec = KeySpec(key, numel, shape[0] if shape else 1, "", shardable=True)
                start, stop = shard_range(spec, shards, index)
                if stop - start != tensor.numel():
                    raise CheckpointReadError(
                        f"{where}: shard {shard}: {name} has {tensor.numel()} elements, "
                        f"neither the whole {tuple(shape)} nor shard {index} of {shards}"
                    )
            if name not in full:
                full[name] = torch.empty(numel, dtype=tensor.dtype)
            full[name][start:stop] = tensor.reshape(-1)
            covered[name].append((start, stop))
        del state, buffer
        if progress is not None:
            progress(record.nbytes)
    absent = [n for n, spans in covered.items() if _uncovered(spans, math.prod(shapes[n]))]
    if absent:
        raise CheckpointReadError(
            f"step {persisted.step}: {len(absent)} parameter(s) are not wholly in any shard, "
            f"e.g. {absent[0]}"
        )
    return {name: full[name].reshape(shapes[name]) for name in shapes}


def _uncovered(spans: list[tuple[int, int]], numel: int) -> bool:
    at = 0
    for start, stop in sorted(spans):
        if start > at:
            return True
        at = max(at, stop)
    return at < numel
