"""The agent core: one tick = collect -> detect -> persist -> problems -> condition -> report.

Collectors, detectors and reporters are injected, so the same ``Agent`` runs against NVML,
/dev/kmsg and the Kubernetes API in a DaemonSet, and against replayed traces in tests.
A failing collector or reporter is logged and counted, never allowed to stop the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bulkhead.agent.collectors.base import Collector, Snapshot
from bulkhead.agent.collectors.training import TrainingCollector
from bulkhead.agent.detect.metric import MetricAnomalyDetector
from bulkhead.agent.detect.persistence import Persistence
from bulkhead.agent.detect.rules import RuleDetector
from bulkhead.agent.health import ConditionView, NodeHealth
from bulkhead.agent.problems import Finding, Problem
from bulkhead.api.node_problems import DEFAULT_SEVERITY, Reason
from bulkhead.api.protocol import WorkerReport
from bulkhead.api.spec import Severity

log = logging.getLogger(__name__)


@dataclass
class TickResult:
    time: float
    problems: list[Problem]
    started: list[Problem]
    resolved: list[Problem]
    condition: ConditionView
    condition_changed: bool
    snapshot: Snapshot | None = None
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0


class Reporter(Protocol):
    def publish(self, result: TickResult) -> None: ...


@dataclass
class Collectors:
    """The registered collectors: ``training`` (also fed by the workers' reports) and any
    others. Each registers the snapshot keys it ``produces``; adding one means appending
    it here, nothing else (a detector rule names the keys it ``reads``)."""

    training: TrainingCollector
    others: list[Collector] = field(default_factory=list)

    def all(self) -> list[Collector]:
        return [self.training, *self.others]

    def produced(self) -> set[str]:
        return {key for c in self.all() for key in c.produces}


class Agent:
    def __init__(
        self,
        collectors: Collectors,
        rules: RuleDetector,
        persistence: Persistence,
        health: NodeHealth,
        reporters: list[Reporter],
        metric: MetricAnomalyDetector | None = None,
        severities: dict[Reason, Severity] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.collectors = collectors
        self.rules = rules
        self.persistence = persistence
        self.health = health
        self.reporters = reporters
        self.metric = metric
        self.severities = {**DEFAULT_SEVERITY, **(severities or {})}
        self.clock = clock
        self._lock = threading.Lock()
        self._problems: dict[tuple[str, str], Problem] = {}
        self.last_tick: float | None = None
        self.last_result: TickResult | None = None
        unread = rules.reads - collectors.produced()
        if unread:
            log.info("no collector produces %s: the rules reading them stay idle", sorted(unread))

    # --- inputs from the API ---------------------------------------------------------------
    def record_report(self, report: WorkerReport) -> bool:
        """False when refused: a new worker while the agent watches as many as it may."""
        return self.collectors.training.record(report, self.clock())

    def problems(self) -> list[Problem]:
        with self._lock:
            return list(self._problems.values())

    # --- the tick --------------------------------------------------------------------------
    def _snapshot(self, now: float, errors: list[str]) -> Snapshot:
        readings: dict[str, Any] = {}
        for collector in self.collectors.all():
            try:
                readings.update(collector.read(now))
            except Exception as exc:  # one broken source must not blind the others
                name = type(collector).__name__
                log.exception("collector %s failed", name)
                errors.append(f"{name}: {exc}")
        return Snapshot(now, readings)

    def tick(self, now: float | None = None) -> TickResult:
        started_at = time.perf_counter()
        now = self.clock() if now is None else now
        errors: list[str] = []
        snap = self._snapshot(now, errors)
        findings = self.rules.detect(snap)
        if self.metric is not None:
            try:
                findings += self.metric.detect(snap)
            except Exception as exc:
                log.exception("multivariate detector failed")
                errors.append(f"metric: {exc}")
        persistent = self.persistence.update(findings)
        started, resolved = self._apply(persistent, now)
        condition, changed = self.health.update(self.problems(), now)
        result = TickResult(now, self.problems(), started, resolved, condition, changed)
        result.snapshot, result.findings, result.errors = snap, findings, errors
        for problem in started:
            log.warning(
                "problem: %s %s [%s] %s",
                problem.reason,
                problem.subject,
                problem.severity,
                problem.message,
            )
        for problem in resolved:
            log.info("resolved: %s %s", problem.reason, problem.subject)
        if changed:
            log.warning(
                "condition %s=%s reason=%s: %s",
                condition.type,
                condition.status,
                condition.reason,
                condition.message,
            )
        result.duration_s = time.perf_counter() - started_at
        for reporter in self.reporters:
            try:
                reporter.publish(result)
            except Exception as exc:  # the API server may be down; keep detecting
                log.exception("reporter %s failed", type(reporter).__name__)
                result.errors.append(f"{type(reporter).__name__}: {exc}")
        self.last_tick, self.last_result = now, result
        return result

    def _apply(self, persistent: list[Finding], now: float) -> tuple[list[Problem], list[Problem]]:
        current = {f.key: f for f in persistent}
        started: list[Problem] = []
        with self._lock:
            resolved = [p for k, p in self._problems.items() if k not in current]
            for key in [k for k in self._problems if k not in current]:
                del self._problems[key]
            for key, finding in current.items():
                severity = finding.severity or self.severities[finding.reason]
                problem = self._problems.get(key)
                if problem is None:
                    problem = Problem(
                        finding.reason,
                        finding.subject,
                        severity,
                        finding.message,
                        since=now,
                        last_seen=now,
                        metrics=finding.metrics,
                    )
                    self._problems[key] = problem
                    started.append(problem)
                else:
                    problem.message, problem.severity, problem.last_seen = (
                        finding.message,
                        severity,
                        now,
                    )
                    problem.metrics = finding.metrics
        return started, resolved

    # --- the loop --------------------------------------------------------------------------
    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Tick every ``interval_s`` until ``stop`` is set (ticks never overlap or pile up)."""
        log.info("agent loop started: interval %.2f s", interval_s)
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("tick failed")
            next_at = max(next_at + interval_s, time.monotonic())
            stop.wait(max(0.0, next_at - time.monotonic()))
        log.info("agent loop stopped")
