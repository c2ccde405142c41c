"""Straggler detection in the trainer: the pure score and verdict, and the monitor over a
real gloo process group (torch's global API and the runtime's per-generation group) where
every rank must reach the same verdict."""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp

from bulkhead.trainer.straggler import StragglerDetector, StragglerMonitor, straggler_scores

WORLD = 3


def test_scores_are_reference_median_over_own_median():
    assert straggler_scores([1.0, 1.0, 1.0, 2.0]) == [1.0, 1.0, 1.0, 0.5]
    scores = straggler_scores([1.0, 1.2, 0.9, 4.0])
    assert scores[3] == pytest.approx(1.1 / 4.0)
    assert straggler_scores([0.0, 1.0]) == [1.0, 1.0]  # no evidence, no verdict
    assert straggler_scores([]) == []


def test_monitor_rejects_bad_parameters():
    with pytest.raises(ValueError, match="threshold"):
        StragglerMonitor(lambda v: None, threshold=1.5)
    with pytest.raises(ValueError, match="every_steps"):
        StragglerMonitor(lambda v: None, every_steps=0)


def test_detector_judges_medians_from_any_gatherer_and_forgets_another_world():
    detector = StragglerDetector(threshold=0.8, patience=2)
    assert detector.judge([1.0, 1.0, 2.0], step=10).ranks == []
    second = detector.judge([1.0, 1.0, 2.0], step=20)
    assert (second.step, second.ranks, second.scores) == (20, [2], [1.0, 1.0, 0.5])
    # four ranks now: the streaks of the old numbering mean nothing
    assert detector.judge([1.0, 1.0, 2.0, 1.0], step=30).ranks == []
    assert detector.judge([1.0, 1.0, 1.0, 1.0], step=40).ranks == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from bulkhead.trainer.engine.device import pick_device
    from bulkhead.trainer.engine.world import World

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        called: list[list[int]] = []
        monitor = StragglerMonitor(
            lambda v: called.append(v.ranks), every_steps=5, threshold=0.8, patience=2
        )
        # the runtime's group object: rank, world_size and an in-place all_reduce
        names = [f"w{r}" for r in range(WORLD)]
        runtime_group = World(0, rank, WORLD, names, names, pick_device())
        on_runtime_group = StragglerMonitor(lambda v: None, runtime_group, every_steps=5)
        verdicts, runtime_verdicts = [], []
        for step in range(20):
            seconds = 1.0 + 0.01 * ((rank + step) % 3)
            if rank == 2 and step >= 5:
                seconds *= 2.0  # persistently slow from the second window on
            if rank == 1 and step < 5:
                seconds *= 3.0  # one slow window only: not a straggler
            verdict = monitor.record(seconds)
            if verdict is not None:
                verdicts.append(verdict.ranks)
            verdict = on_runtime_group.record(seconds)
            if verdict is not None:
                runtime_verdicts.append(verdict.ranks)
        results.put((rank, verdicts, called, runtime_verdicts))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_ranks_agree_on_a_persistent_straggler():
    # fork: the children inherit the imported torch (spawn re-imports it: seconds per rank)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        collected = {r: rest for r, *rest in (results.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for rank in range(WORLD):
        verdicts, called, runtime_verdicts = collected[rank]
        # windows end at steps 5, 10, 15, 20; rank 2 slow from window 2, patience 2
        assert verdicts == [[], [], [2], [2]], (rank, verdicts)
        assert called == [[2], [2]]
        assert runtime_verdicts == verdicts


def test_node_agent_report_is_a_valid_agent_report_for_the_straggler_only():
    from bulkhead.api.protocol import WorkerReport
    from bulkhead.trainer.straggler import StragglerVerdict, node_agent_report

    verdict = StragglerVerdict(step=100, ranks=[2], scores=[1.0, 1.0, 0.5])
    assert node_agent_report("job-w0", 100, 0, verdict) is None
    body = node_agent_report("job-w2", 100, 2, verdict)
    report = WorkerReport.model_validate_json(body.model_dump_json(by_alias=True))
    assert report.stragglers == ["job-w2"] and report.straggler_scores == {"job-w2": 0.5}
