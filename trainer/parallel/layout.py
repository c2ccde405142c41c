"""Which rank holds which bytes of the training state under a plan (pure, no torch).

Every piece of training state has a *key*: ``param/<name>``, ``optim/<name>/<slot>``
(AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``) and
``buffer/<name>``. A key is a flat array of ``numel`` elements, ``rows`` long in its first
dimension. Shardable keys (parameters and their optimizer slots) are split under a
sharded layout along the first dimension the way FSDP2's ``Shard(0)``
splits them (``torch.chunk``: chunks of ceil(rows / S) rows, the last ones shorter or
empty); replicated keys (scalars, buffers) are held whole by everyone.

Under expert parallelism a key may belong to a *group* (``expert/<block>/<expert>``: the
parameters and optimizer state of one expert); a holding that lists its groups holds
only the grouped keys of those groups, plus every key of no group.

A rank describes what it holds with a ``Holding``: the step its state is at and the shard
of the layout it had. From the holdings of all ranks every rank computes the same
element ranges, with no byte of state exchanged to find out.
"""

from __future__ import annotations

from dataclasses import dataclass

Range = tuple[int, int]  # [start, stop) in flat elements


@dataclass(frozen=True)
class KeySpec:
    name: str
    numel: int
    rows: int
    dtype: str
    shardable: bool  # split by every sharded layout (parameters, their optimizer slots)
    group: str = ""  # held only by holdings listing it ("" = held by every holding)

    @property
    def row_elements(self) -> int:
        return self.numel // self.rows if self.rows else 0


@dataclass(frozen=True)
class Holding:
    """What one rank holds: nothing, or its shard ``index`` of ``shards`` at ``step``."""

    step: int  # completed steps of the held state (-1 = holds nothing)
    shards: int  # 1 = the whole state
    index: int
    groups: frozenset[str] | None = None  # the key groups held (None = every group)

    @property
    def empty(self) -> bool:
        return self.step < 0

    def encode(self) -> tuple[int, int, int]:
        return (self.step, self.shards, self.index)

    @classmethod
    def decode(cls, values: tuple[int, int, int] | list[int]) -> Holding:
        step, shards, index = (int(v) for v in values)
        return cls(step=step, shards=shards, index=index)


NOTHING = Holding(step=-1, shards=1, index=0)


def shard_range(spec: KeySpec, shards: int, index: int) -> Range:
    """The element range of ``spec`` that shard ``index`` of ``shards`` holds."""
    if not spec.shardable or shards <= 1:
        return (0, spec.numel)
    chunk = -(-spec.rows // shards)  # ceil: torch.chunk's row count
    start_row = min(index * chunk, spec.rows)
    stop_row = min(start_row + chunk, spec.rows)
    cols = spec.row_elements
    return (start_row * cols, stop_row * cols)


def ranges_of(holding: Holding, specs: list[KeySpec]) -> dict[str, Range]:
    """Every key's range under ``holding`` (empty ranges omitted)."""
    if holding.empty:
        return {}
    out: dict[str, Range] = {}
    for spec in specs:
        if spec.group and holding.groups is not None and spec.group not in holding.groups:
            continue
        start, stop = shard_range(spec, holding.shards, holding.index)
        if stop > start:
            out[spec.name] = (start, stop)
    return out


def needed_ranges(
    shards: int, index: int, specs: list[KeySpec], groups: frozenset[str] | None = None
) -> dict[str, Range]:
    """What a rank must hold to be shard ``index`` of ``shards`` (and hold ``groups``)."""
    return ranges_of(Holding(step=0, shards=shards, index=index, groups=groups), specs)
