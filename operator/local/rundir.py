"""The run directory of a local run: what happened, written as it happens.

Layout::

    metrics.jsonl   one line per completed step: t, step, loss, tokens_per_s (job throughput),
                    generation, workers, worker_tokens_per_s (per-worker compute), val_loss
                    (the evaluation after the step, if spec.trainer.eval made one)
    events.jsonl    one line per lifecycle event: t, time, reason, message, warning
    summary.json    written at the end (atomically): steps, lost steps, faults, recoveries
    plot.png        loss and throughput over time with failure and recovery markers
    logs/           one log file per worker incarnation
    samples.jsonl   written by the trainer's rank 0: the samples of every committed step

Lines are flushed one by one, so a crash of the supervisor loses nothing already recorded.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


@dataclass
class MetricRow:
    t: float
    step: int
    loss: float | None
    tokens_per_s: float | None  # job throughput (throughput.py)
    generation: int
    workers: int
    # Per-worker compute throughput: the mean of the members' own reports (global batch
    # tokens / that worker's step time); not the job's rate.
    worker_tokens_per_s: float | None = None
    val_loss: float | None = None  # the evaluation after this step, if any


@dataclass
class EventRow:
    t: float
    reason: str
    message: str
    warning: bool


@dataclass
class RunRecorder:
    run_dir: Path
    clock: Callable[[], float] = time.monotonic
    metrics: list[MetricRow] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._t0 = self.clock()
        self._metrics_file = (self.run_dir / "metrics.jsonl").open("a", buffering=1)
        self._events_file = (self.run_dir / "events.jsonl").open("a", buffering=1)
        self.listeners: list[Callable[[EventRow], None]] = []

    def elapsed(self) -> float:
        return round(self.clock() - self._t0, 3)

    def metric(
        self,
        step: int,
        loss: float | None,
        tokens_per_s: float | None,
        generation: int,
        workers: int,
        *,
        t: float | None = None,
        worker_tokens_per_s: float | None = None,
        val_loss: float | None = None,
    ) -> MetricRow:
        """One completed step; ``t`` (seconds since the run started, default now) is the
        time the throughput was measured at, so the file and the figure agree."""
        row = MetricRow(
            self.elapsed() if t is None else t,
            step,
            loss,
            tokens_per_s,
            generation,
            workers,
            worker_tokens_per_s,
            val_loss,
        )
        self.metrics.append(row)
        self._metrics_file.write(json.dumps(row.__dict__) + "\n")
        return row

    def event(self, reason: str, message: str, warning: bool = False) -> EventRow:
        row = EventRow(self.elapsed(), reason, message, warning)
        self.events.append(row)
        line = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), **row.__dict__}
        self._events_file.write(json.dumps(line) + "\n")
        for listener in self.listeners:
            listener(row)
        return row

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        self._metrics_file.close()
        self._events_file.close()
