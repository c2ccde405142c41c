"""The pipeline stages' point-to-point programs finish under NCCL's ordering rule (each
rank's operations in issue order, a send waiting for its receive), for every schedule,
depth and micro-batch count; the orders the executor used before do not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bulkhead.trainer.parallel.p2p_program import (
    ACTIVATIONS,
    GRADIENTS,
    P2PBatch,
    Transfer,
    runs_to_completion,
    stage_program,
)
from bulkhead.trainer.parallel.pipeline_plan import schedule


def programs(kind: str, stages: int, microbatches: int, forward_only: bool = False) -> list:
    out = []
    for s in range(stages):
        ops = schedule(kind, stages, s, microbatches)
        if forward_only:  # evaluation
            ops = [op for op in ops if op[0] == "F"]
        out.append(stage_program(ops, s == 0, s == stages - 1))
    return out


@given(
    kind=st.sampled_from(["1F1B", "GPipe"]),
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 12),
    forward_only=st.booleans(),
)
def test_every_schedule_runs_to_completion_and_moves_each_hand_off_once(
    kind: str, stages: int, microbatches: int, forward_only: bool
) -> None:
    progs = programs(kind, stages, microbatches, forward_only)
    assert runs_to_completion(progs)
    for s, program in enumerate(progs):
        transfers = [t for batch in program for t in batch]
        assert len(transfers) == len(set(transfers))
        expected = set()
        for i in range(microbatches):
            if s > 0:
                expected.add(Transfer("recv", ACTIVATIONS, i))
            if s < stages - 1:
                expected.add(Transfer("send", ACTIVATIONS, i))
            if not forward_only and s < stages - 1:
                expected.add(Transfer("recv", GRADIENTS, i))
            if not forward_only and s > 0:
                expected.add(Transfer("send", GRADIENTS, i))
        assert set(transfers) == expected
    # Both sides of a link issue its hand-offs in the same order (NCCL matches by order).
    for s in range(stages - 1):
        up, down = progs[s], progs[s + 1]
        assert order(up, "send", ACTIVATIONS) == order(down, "recv", ACTIVATIONS)
        assert order(down, "send", GRADIENTS) == order(up, "recv", GRADIENTS)


def order(program: list, kind: str, what: str) -> list[int]:
    return [t.microbatch for b in program for t in b if (t.kind, t.what) == (kind, what)]


def test_a_pass_receives_before_it_runs_and_sends_after() -> None:
    ops = schedule("1F1B", 2, 0, 3)  # F0 F1 B0 F2 B1 B2 on the first stage
    program = stage_program(ops, first=True, last=False)
    assert program[0] == ()  # the first stage reads its tokens
    assert program[2] == (Transfer("send", ACTIVATIONS, 1), Transfer("recv", GRADIENTS, 0))
    assert program[-1] == ()  # the first stage sends nothing after its last backward
    last = stage_program(schedule("1F1B", 2, 1, 3), first=False, last=True)
    assert last[0] == (Transfer("recv", ACTIVATIONS, 0),)
    assert last[-1] == (Transfer("send", GRADIENTS, 2),)


def _posted_one_ahead(ops: list, first: bool, last: bool) -> list[P2PBatch]:
    """The executor's order until session 46: every receive posted one pass ahead, each
    operation issued on its own."""
    forwards = [i for k, i in ops if k == "F"]
    backwards = [i for k, i in ops if k == "B"]
    issued: list[Transfer] = []
    if not first:
        issued.append(Transfer("recv", ACTIVATIONS, forwards[0]))
    if not last:
        issued.append(Transfer("recv", GRADIENTS, backwards[0]))
    for kind, i in ops:
        what, order = (ACTIVATIONS, forwards) if kind == "F" else (GRADIENTS, backwards)
        receives = not first if kind == "F" else not last
        nxt = order.index(i) + 1
        if receives and nxt < len(order):
            issued.append(Transfer("recv", what, order[nxt]))
        if (kind == "F" and not last) or (kind == "B" and not first):
            issued.append(Transfer("send", what, i))
    return [(t,) for t in issued]


def _one_by_one(ops: list, first: bool, last: bool) -> list[P2PBatch]:
    """Each receive posted just before its pass, but apart from the sends."""
    return [(t,) for batch in stage_program(ops, first, last) for t in batch]


def test_the_orders_without_batches_hang_under_nccl() -> None:
    for order in (_posted_one_ahead, _one_by_one):
        progs = [order(schedule("1F1B", 2, s, 4), s == 0, s == 1) for s in range(2)]
        assert not runs_to_completion(progs), order.__name__


def test_a_receive_with_no_matching_send_never_completes() -> None:
    progs = [[(Transfer("recv", GRADIENTS, 0),)], [()]]
    assert not runs_to_completion(progs)
