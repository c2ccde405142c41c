"""Evaluation in the real elastic runtime (real worker processes, file-based manager).

c is killed in the middle of the evaluation after step 3: the survivors fail out of it
with the state of step 3, re-form, evaluate step 3 again first thing in generation 2 and
report it with that step (no step redone). b is then killed in step 8, right after the
evaluation of step 7 finished: a goes on alone from step 8 without evaluating step 7
again, and ends with the final evaluation."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from elastic_harness import Manager, read_lines, tiny_spec, worker_main
from processes import preloaded_context

pytestmark = pytest.mark.slow

CTX = preloaded_context()
STEPS = 12
# b's reads of training samples before step 8: steps 0-3 in a world of 3 (3 samples: one
# micro-batch of 4), steps 4-7 in a world of 2 (5 samples: two micro-batches).
B_DIES_AT_READ = 4 * 1 + 4 * 2 + 1


def _start(
    root: Path, worker: str, spec: dict, mid_eval: bool = False, read: int = 0
) -> mp.Process:
    args = (str(root), worker, spec, None, 0.0, mid_eval, read)
    proc = CTX.Process(target=worker_main, args=args, name=worker)
    proc.start()
    return proc


def test_an_evaluation_is_redone_only_when_no_survivor_finished_it(tmp_path: Path) -> None:
    spec = tiny_spec(eval={"intervalSteps": 4, "batches": 2})
    mgr = Manager(tmp_path)
    procs = {
        "a": _start(tmp_path, "a", spec),
        "b": _start(tmp_path, "b", spec, read=B_DIES_AT_READ),
        "c": _start(tmp_path, "c", spec, mid_eval=True),
    }

    def faults() -> int:
        return len(read_lines(tmp_path / "faults.jsonl"))

    try:
        mgr.wait("3 registrations", lambda: len(mgr.addresses()) == 3)
        g1 = mgr.publish(["a", "b", "c"], STEPS)
        procs["c"].join(120)
        assert procs["c"].exitcode == -9
        mgr.wait("a's and b's fault reports", lambda: faults() >= 2)
        g2 = mgr.publish(["a", "b"], STEPS)
        procs["b"].join(120)
        assert procs["b"].exitcode == -9
        mgr.wait("a's fault report", lambda: faults() >= 3)
        g3 = mgr.publish(["a"], STEPS)
        procs["a"].join(120)
        assert procs["a"].exitcode == 0
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
    reported = read_lines(tmp_path / "faults.jsonl")
    assert {f["kind"] for f in reported} == {"collective_error"}
    assert all("evaluation" in f["message"] for f in reported[:2]), reported[:2]
    progress = mgr.progress()

    def steps(generation: int) -> list[int]:
        return [p["step"] for p in progress if p["generation"] == generation]

    def evaluated(generation: int) -> dict[int, float]:
        return {
            p["step"]: p["valLoss"]
            for p in progress
            if p["generation"] == generation and "valLoss" in p
        }

    # Generation 1 reported steps 0-2: step 3 waits for its evaluation, which never ended.
    assert steps(g1.generation) == [0, 1, 2] and evaluated(g1.generation) == {}
    # Generation 2 starts with step 3's evaluation, then trains 4-7 and evaluates step 7.
    assert steps(g2.generation) == [3, 4, 5, 6, 7]
    assert evaluated(g2.generation).keys() == {3, 7}
    # Generation 3: step 7's evaluation had finished on a, so a trains on from step 8.
    assert steps(g3.generation) == [8, 9, 10, 11]
    assert evaluated(g3.generation).keys() == {11}
    log = (tmp_path / "a.log").read_text()
    assert log.count("evaluation after step 3:") == 1  # the interrupted one is not logged
    assert log.count("evaluation after step 7:") == 1
    # Every step was committed once; the validation loss went down.
    assert sorted(e["step"] for e in read_lines(tmp_path / "samples.jsonl")) == list(range(STEPS))
    first, last = evaluated(g2.generation)[3], evaluated(g3.generation)[11]
    assert 0 < last < first
