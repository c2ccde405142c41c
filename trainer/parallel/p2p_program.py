"""The point-to-point program of a pipeline stage's step: which sends and receives are
issued together, and in which order.

Why it is a program and not "send when ready, receive one pass ahead": NCCL runs a
rank's point-to-point operations in the order they are issued, and a send may block until
the peer has posted the matching receive (NVIDIA/nccl#479, #783). Two neighbouring stages
that each post their next receive before the send the other is waiting for hang: the
first stage waiting for the gradient of micro-batch 0 ahead of its send of activations 1,
the second waiting for activations 1 ahead of its send of that gradient. Gloo never blocks
a send, so only a GPU would show it. The rule that is safe on both, the one
``torch.distributed.pipelining`` follows: after each pass, issue its sends *together* with
the receives the next pass needs, as one batch (``batch_isend_irecv``: one NCCL group, whose
operations progress together).

``stage_program`` builds that program from the stage's pass order (``schedule``);
``runs_to_completion`` checks a pipeline's programs under NCCL's rule (each rank's batches
in order; a batch completes only with the peers' batches holding its counterparts), which
``tests/engine/test_p2p_program.py`` uses to show the old order hangs and this one does not.

No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ACTIVATIONS, GRADIENTS = "activations", "gradients"


@dataclass(frozen=True)
class Transfer:
    """One hand-off of a micro-batch's activations (to the next stage) or of their
    gradients (to the stage before), as the sending or the receiving stage sees it."""

    kind: Literal["send", "recv"]
    what: str  # ACTIVATIONS | GRADIENTS
    microbatch: int

    @property
    def peer_offset(self) -> int:
        """The other stage, relative to this one: activations go down the pipeline,
        gradients back up."""
        down = 1 if self.what == ACTIVATIONS else -1
        return down if self.kind == "send" else -down

    def counterpart(self) -> Transfer:
        return Transfer("recv" if self.kind == "send" else "send", self.what, self.microbatch)


P2PBatch = tuple[Transfer, ...]


def _sends(op: tuple[str, int], first: bool, last: bool) -> list[Transfer]:
    kind, i = op
    if kind == "F":
        return [] if last else [Transfer("send", ACTIVATIONS, i)]
    return [] if first else [Transfer("send", GRADIENTS, i)]


def _receives(op: tuple[str, int], first: bool, last: bool) -> list[Transfer]:
    kind, i = op
    if kind == "F":
        return [] if first else [Transfer("recv", ACTIVATIONS, i)]
    return [] if last else [Transfer("recv", GRADIENTS, i)]


def stage_program(ops: Sequence[tuple[str, int]], first: bool, last: bool) -> list[P2PBatch]:
    """``len(ops) + 1`` batches: batch ``k`` is issued before pass ``k`` runs (its
    receives are what pass ``k`` needs; its sends are pass ``k - 1``'s outputs), the
    last one after the last pass."""
    program: list[P2PBatch] = []
    previous: list[Transfer] = []
    for op in ops:
        program.append((*previous, *_receives(op, first, last)))
        previous = _sends(op, first, last)
    program.append(tuple(previous))
    return program


def runs_to_completion(programs: Sequence[Sequence[P2PBatch]]) -> bool:
    """Whether the stages of one pipeline (``programs[s]``: stage ``s``'s batches, in
    issue order) finish under NCCL's rule: a stage runs its batches one after the other
    (the next starts when every transfer of the current one is done), and a transfer is
    done only when its counterpart is in the peer's current batch (a send may wait for its
    receive to be posted, a receive for its send); the transfers of one batch progress
    independently. False: the stages wait on each other for ever."""
    heads = [0] * len(programs)
    done: set[tuple[int, Transfer]] = set()

    def current(s: int) -> P2PBatch:
        return programs[s][heads[s]] if heads[s] < len(programs[s]) else ()

    while any(h < len(p) for h, p in zip(heads, programs, strict=True)):
        progressed = False
        for s in range(len(programs)):
            for transfer in current(s):
                peer = s + transfer.peer_offset
                twin = transfer.counterpart()
                if (
                    (s, transfer) not in done
                    and 0 <= peer < len(programs)
                    and twin in current(peer)
                ):
                    done.update({(s, transfer), (peer, twin)})
                    progressed = True
        for s in range(len(programs)):
            if heads[s] < len(programs[s]) and all((s, t) in done for t in current(s)):
                heads[s] += 1
                progressed = True
        if not progressed:
            return False
    return True
