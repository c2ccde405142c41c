"""The executor of a stage's point-to-point program: what it waits for before a pass,
under gloo's one work per operation and under NCCL's one work per grouped batch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from bulkhead.trainer.engine.pipeline import StageExchange
from bulkhead.trainer.parallel.p2p_program import ACTIVATIONS, GRADIENTS, Transfer


class FakeWork:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    # P2POp needs a default group to name its peer; nothing is sent through it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _exchange(issued: list, works_per_batch: str, stats: int = 0) -> StageExchange:
    def issue(ops: list[dist.P2POp]) -> list[FakeWork]:
        count = len(ops) if works_per_batch == "per-op" else 1
        works = [FakeWork() for _ in range(count)]
        issued.append((ops, works))
        return works

    return StageExchange(
        lambda _offset: 0, lambda _i: (2, 3), torch.float32, torch.device("cpu"), stats, issue
    )


def test_per_operation_works_wait_for_receives_now_and_sends_at_the_end(one_rank_group) -> None:
    issued: list = []
    exchange = _exchange(issued, "per-op", stats=4)
    exchange.hold(Transfer("send", ACTIVATIONS, 1), torch.ones(2, 3), torch.ones(4))
    got = exchange.run((Transfer("send", ACTIVATIONS, 1), Transfer("recv", GRADIENTS, 0)))
    ops, works = issued[0]
    # The activations, then the statistics (tag 1), then the receives in the same order.
    assert [(op.op is dist.isend, op.tag) for op in ops] == [
        (True, 0), (True, 1), (False, 0), (False, 1)
    ]  # fmt: skip
    grad, stats = got[Transfer("recv", GRADIENTS, 0)]
    assert grad.shape == (2, 3) and stats.shape == (4,)
    assert not exchange.outbox
    assert [w.waited for w in works] == [0, 0, 1, 1]
    assert len(exchange.sending) == 2
    exchange.finish()
    assert [w.waited for w in works] == [1, 1, 1, 1]
    assert not exchange.sending


def test_a_grouped_batch_is_one_work_waited_before_the_pass(one_rank_group) -> None:
    issued: list = []
    exchange = _exchange(issued, "grouped")
    exchange.hold(Transfer("send", GRADIENTS, 0), torch.ones(2, 3))
    got = exchange.run((Transfer("send", GRADIENTS, 0), Transfer("recv", ACTIVATIONS, 1)))
    ops, works = issued[0]
    assert len(ops) == 2 and Transfer("recv", ACTIVATIONS, 1) in got
    assert [w.waited for w in works] == [1]  # the receive is in it: before the pass
    assert not exchange.sending


def test_an_empty_batch_issues_nothing(one_rank_group) -> None:
    issued: list = []
    assert _exchange(issued, "per-op").run(()) == {}
    assert issued == []
