"""Token dispatch to replicated experts: which routed token goes to which rank (pure numpy).

Every rank routes its tokens, the ranks exchange their per-expert counts, and from the
same (experts x ranks) count and replica matrices every rank derives the same quotas
(``planning.dispatch_quotas.dispatch_quotas``: each expert's tokens whole on one replica
where the load allows, else split over its replicas in proportion to their slots; a
rank's own replica first). ``DispatchLayout`` turns the quotas into one rank's side of an
uneven all-to-all:

- the order in which it sends its routed (token, expert) assignments: destination by
  destination, expert by expert within each, and within an expert in routing order (the
  first ones stay local, the overflow goes to the other replicas in rank order);
- the split sizes in and out (a rank's split to itself is the same both ways, as gloo
  requires);
- for every expert it hosts, the rows of the received buffer that are for it;
- which replicas compute (every rank's: their hosts sum only those replicas' gradients).

No assignment is dropped or padded: rows out and in are exactly the routed assignments.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from bulkhead.trainer.planning.dispatch_quotas import dispatch_quotas


@dataclass(frozen=True)
class DispatchLayout:
    rank: int
    send: np.ndarray  # (experts, ranks, ranks): assignments of expert e that i sends to j

    @classmethod
    def of(
        cls, rank: int, counts: np.ndarray, replicas: np.ndarray, slack: float
    ) -> DispatchLayout:
        """``counts``: (ranks, experts) routed assignments; ``replicas``: (experts, ranks);
        ``slack``: the concentration slack."""
        return cls(rank, dispatch_quotas(np.asarray(counts).T, replicas, slack))

    @cached_property
    def computing(self) -> np.ndarray:
        """(experts, ranks): whether the rank's replica of the expert receives tokens."""
        return self.send.sum(axis=1) > 0

    @cached_property
    def input_splits(self) -> list[int]:
        """Rows this rank sends to each rank."""
        return self.send[:, self.rank, :].sum(axis=0).tolist()

    @cached_property
    def output_splits(self) -> list[int]:
        """Rows this rank receives from each rank."""
        return self.send[:, :, self.rank].sum(axis=0).tolist()

    def send_order(self, experts_of: np.ndarray) -> np.ndarray:
        """Indices into this rank's assignments (``experts_of[a]``: expert of assignment a)
        in the order they are sent."""
        order = np.argsort(experts_of, kind="stable")
        starts = np.concatenate([[0], np.cumsum(np.bincount(experts_of, minlength=len(self.send)))])
        mine = self.send[:, self.rank, :]  # (experts, destinations)
        # Within an expert: destinations in rank order take consecutive runs.
        offsets = starts[:-1, None] + np.concatenate(
            [np.zeros((len(mine), 1), dtype=np.int64), np.cumsum(mine, axis=1)[:, :-1]], axis=1
        )
        pieces = [
            order[offsets[e, j] : offsets[e, j] + mine[e, j]]
            for j in range(mine.shape[1])
            for e in range(mine.shape[0])
            if mine[e, j]
        ]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def received_rows(self) -> dict[int, np.ndarray]:
        """Expert -> rows of the received buffer holding its assignments (each source's
        block is ordered by expert); computed once per layout (layouts are reused)."""
        return self._received_rows

    @cached_property
    def _received_rows(self) -> dict[int, np.ndarray]:
        incoming = self.send[:, :, self.rank]  # (experts, sources)
        block_starts = np.concatenate([[0], np.cumsum(incoming.sum(axis=0))])
        rows: dict[int, list[np.ndarray]] = {}
        for source in range(incoming.shape[1]):
            position = block_starts[source]
            for e in range(incoming.shape[0]):
                n = int(incoming[e, source])
                if n:
                    rows.setdefault(e, []).append(np.arange(position, position + n))
                position += n
        return {e: np.concatenate(parts) for e, parts in rows.items()}
