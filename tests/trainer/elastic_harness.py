"""Test harness for the elastic runtime: a file-based stand-in for the lifecycle manager.

The test process plays the manager: it reads registrations and reports from files and
publishes membership generations by writing ``membership.json``. Workers run the real
``ElasticTrainer`` in real processes with real gloo groups; only the control endpoint is
replaced (the HTTP endpoint is covered by the operator's tests).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bulkhead.api.protocol import (
    CompletionReport,
    Directive,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
)
from bulkhead.api.status import Member

POLL_S = 0.05


def _append(path: Path, data: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(data) + "\n").encode())
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FileControl:
    """The ControlChannel interface over files in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def register(self, request: RegisterRequest) -> RegisterResponse:
        _append(self.root / "registered.jsonl", request.wire())
        return RegisterResponse(worker=request.worker, generation=self._current().generation)

    def _current(self) -> MembershipView:
        path = self.root / "membership.json"
        if not path.exists():
            return MembershipView()
        return MembershipView.model_validate_json(path.read_text())

    def membership(self, after: int = 0, timeout_s: float = 30.0) -> MembershipView:
        deadline = time.monotonic() + timeout_s
        while True:
            view = self._current()
            if view.generation > after or time.monotonic() >= deadline:
                return view
            time.sleep(POLL_S)

    def _directive(self, generation: int) -> Directive:
        current = self._current().generation
        action = "reconfigure" if generation < current else "continue"
        return Directive(action=action, generation=current)

    def progress(self, report: ProgressReport) -> Directive:
        if report.setup is not None:  # set-up news carries no step (the manager's reading)
            _append(self.root / "setup.jsonl", report.wire())
            return self._directive(report.generation)
        # A line per step, as the manager reads a report (its own step and those before).
        for figures in report.figures():
            line = {"worker": report.worker, "generation": report.generation}
            _append(self.root / "progress.jsonl", line | figures.wire())
        return self._directive(report.generation)

    def fault(self, report: FaultReport) -> Directive:
        _append(self.root / "faults.jsonl", report.wire())
        return self._directive(report.generation)

    def complete(self, report: CompletionReport) -> Directive:
        _append(self.root / "complete.jsonl", report.wire())
        return self._directive(report.generation)


class Manager:
    """The test's side: wait for registrations and progress, publish generations."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0

    def addresses(self) -> dict[str, str]:
        return {r["worker"]: r["address"] for r in read_lines(self.root / "registered.jsonl")}

    def publish(self, workers: list[str], total_steps: int) -> MembershipView:
        addresses = self.addresses()
        self.generation += 1
        members = [
            Member(rank=i, worker=w, node=f"local-{i}", address=addresses[w])
            for i, w in enumerate(workers)
        ]
        view = MembershipView(
            generation=self.generation,
            coordinator=members[0].address,
            members=members,
            state="running",
            total_steps=total_steps,
        )
        tmp = self.root / "membership.tmp"
        tmp.write_text(view.model_dump_json(by_alias=True))
        os.replace(tmp, self.root / "membership.json")
        return view

    def wait(self, what: str, condition: Any, timeout_s: float = 120.0) -> Any:
        """Wait (with a deadline) until ``condition()`` is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(POLL_S)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

    def progress(self) -> list[dict[str, Any]]:
        return read_lines(self.root / "progress.jsonl")

    def max_step(self, generation: int | None = None) -> int:
        steps = [
            p["step"]
            for p in self.progress()
            if generation is None or p["generation"] == generation
        ]
        return max(steps, default=-1)


def tiny_spec(**trainer: Any) -> dict[str, Any]:
    """A small job spec (wire form) whose steps take milliseconds on one CPU thread."""
    import sysconfig

    data = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
    spec: dict[str, Any] = {
        "workers": 3,
        "trainer": {
            "model": {
                "dModel": 32,
                "nLayers": 2,
                "nHeads": 2,
                "seqLen": 32,
                "ffnDim": 64,
                "moe": {"numExperts": 4, "topK": 2, "every": 2},
            },
            "batch": {"globalBatchSize": 10, "microBatchSize": 4},
            "optimizer": {"lr": 0.003},
            "data": {"source": data},
            "steps": 1000,
            # The tests judge lost steps by the newest step this file manager has seen.
            "reportIntervalSeconds": 0,
        },
        "faultTolerance": {"collectiveTimeoutSeconds": 20, "registrationTimeoutSeconds": 120},
    }
    spec["trainer"].update(trainer)
    return spec


def worker_main(
    root: str,
    worker: str,
    spec_wire: dict[str, Any],
    agent_url: str | None = None,
    slow_forward_s: float = 0.0,
    die_mid_eval: bool = False,
    die_at_train_read: int = 0,
) -> None:
    """A worker process: the real ElasticTrainer with the file-based control (and, given
    ``agent_url``, reporting to that node agent; ``slow_forward_s`` makes it a straggler;
    ``die_mid_eval``: it kills itself on its second read of evaluation samples,
    ``die_at_train_read``: on that read of training samples)."""
    import logging

    import torch

    from bulkhead.api.spec import TrainingJobSpec
    from bulkhead.trainer.config import train_config
    from bulkhead.trainer.data import open_datasets
    from bulkhead.trainer.runtime.loop import ElasticTrainer, WorkerIdentity
    from bulkhead.trainer.runtime.node_agent import NodeAgentReporter
    from bulkhead.trainer.runtime.samples_log import SamplesLog

    torch.set_num_threads(1)
    base = Path(root)
    import faulthandler
    import signal

    trace = (base / f"{worker}.stacks").open("w")
    faulthandler.register(signal.SIGUSR1, file=trace, all_threads=True)
    logging.basicConfig(
        filename=base / f"{worker}.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    cfg = train_config(TrainingJobSpec.model_validate(spec_wire))
    datasets = open_datasets(cfg)
    evaluation = datasets.eval
    if die_mid_eval:
        assert evaluation is not None
        evaluation = _DiesMidway(evaluation, 2)
    train = _DiesMidway(datasets.train, die_at_train_read) if die_at_train_read else None
    trainer = ElasticTrainer(
        cfg,
        lambda: FileControl(base),
        WorkerIdentity(worker, "local", 0, "127.0.0.1"),
        train or datasets.train,
        SamplesLog(base / "samples.jsonl", cfg.global_batch_size),
        node_agent=NodeAgentReporter(agent_url, "elastic", token="t") if agent_url else None,
        eval_dataset=evaluation,
    )
    if slow_forward_s:
        import time

        from torch.nn.modules.module import register_module_forward_hook

        from bulkhead.trainer.models.protocol import CausalLM

        def slow(module: object, *_: object) -> None:
            if isinstance(module, CausalLM):  # once per model forward, whichever engine built it
                time.sleep(slow_forward_s)

        register_module_forward_hook(slow)
    trainer.run()
    assert trainer.held is not None
    torch.save(trainer.held.tensors, base / f"final-{worker}.pt")
    logging.shutdown()
    # Like bulkhead-worker: skip the interpreter's teardown, which would wait for the gloo
    # group parked after an abandoned collective (until its timeout).
    os._exit(0)


class _DiesMidway:
    """A dataset whose ``fatal``-th read kills this process (SIGKILL)."""

    def __init__(self, dataset: Any, fatal: int) -> None:
        self.dataset = dataset
        self.fatal = fatal
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)

    def batch(self, positions: Any) -> Any:
        self.reads += 1
        if self.reads == self.fatal:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.dataset.batch(positions)
