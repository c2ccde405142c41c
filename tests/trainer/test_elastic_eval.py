"""Evaluation in the real elastic runtime (real worker processes, file-based manager): a
worker killed in the middle of an evaluation; the survivors fail out of it with the state
of the step it follows, re-form, evaluate that step again first thing in the next
generation, report it with that step, and train on to the final evaluation."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from elastic_harness import Manager, read_lines, tiny_spec, worker_main
from processes import preloaded_context

pytestmark = pytest.mark.slow

CTX = preloaded_context()
STEPS = 8


def _start(root: Path, worker: str, spec: dict, die_mid_eval: bool = False) -> mp.Process:
    args = (str(root), worker, spec, None, 0.0, die_mid_eval)
    proc = CTX.Process(target=worker_main, args=args, name=worker)
    proc.start()
    return proc


def test_a_kill_mid_evaluation_is_redone_by_the_next_generation(tmp_path: Path) -> None:
    spec = tiny_spec(eval={"intervalSteps": 4, "batches": 2})
    mgr = Manager(tmp_path)
    procs = {w: _start(tmp_path, w, spec, die_mid_eval=w == "c") for w in ("a", "b", "c")}
    try:
        mgr.wait("3 registrations", lambda: len(mgr.addresses()) == 3)
        g1 = mgr.publish(["a", "b", "c"], STEPS)
        # c dies in the evaluation after step 3; a and b fail out of it and report.
        procs["c"].join(120)
        assert procs["c"].exitcode == -9
        mgr.wait(
            "both survivors' fault reports", lambda: len(read_lines(tmp_path / "faults.jsonl")) >= 2
        )
        g2 = mgr.publish(["a", "b"], STEPS)
        for w in ("a", "b"):
            procs[w].join(120)
            assert procs[w].exitcode == 0, w
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
    faults = read_lines(tmp_path / "faults.jsonl")
    assert {f["kind"] for f in faults} == {"collective_error"}
    assert any("evaluation" in f["message"] for f in faults), faults
    progress = mgr.progress()
    first = [p for p in progress if p["generation"] == g1.generation]
    second = [p for p in progress if p["generation"] == g2.generation]
    # Generation 1 reported steps 0-2: step 3 waits for its evaluation, which never ended.
    assert [p["step"] for p in first] == [0, 1, 2] and not any("valLoss" in p for p in first)
    # Generation 2 starts with step 3's evaluation (no step redone), then trains to the end.
    assert [p["step"] for p in second] == [3, 4, 5, 6, 7]
    evaluated = {p["step"]: p["valLoss"] for p in second if "valLoss" in p}
    assert evaluated.keys() == {3, 7}
    assert 0 < evaluated[7] < evaluated[3] < first[0]["loss"] + 1  # finite, and it learned
    steps = sorted(e["step"] for e in read_lines(tmp_path / "samples.jsonl"))
    assert steps == list(range(STEPS))  # every step committed once
