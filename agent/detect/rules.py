"""Rule detectors: known fault signatures in one snapshot (plus the previous counters).

Each rule returns findings for this tick only; persistence (k of n) and severities are
applied afterwards, so every rule stays a small pure function of what was observed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from bulkhead.agent.collectors.base import (
    EXPECTED_GPUS,
    GPUS,
    HOST,
    WORKERS,
    XIDS,
    GpuSample,
    Snapshot,
    WorkerState,
)
from bulkhead.agent.collectors.gpu import POWER_BRAKE_MASK, THERMAL_THROTTLE_MASK
from bulkhead.agent.detect.change import RobustChange
from bulkhead.agent.problems import Finding
from bulkhead.agent.xid import XidEvent
from bulkhead.api.node_problems import Reason


@dataclass(frozen=True)
class RuleThresholds:
    hang_timeout_s: float = 120.0
    pcie_replays_per_tick: int = 100
    memory_available_min_frac: float = 0.03
    step_time_z: float = 8.0


def gpu_subject(gpu: GpuSample) -> str:
    return f"gpu{gpu.index}"


class Rule(Protocol):
    """A detector rule: names the snapshot keys it ``reads`` (see ``collectors.base``)."""

    reads: tuple[str, ...]

    def check(self, snap: Snapshot) -> list[Finding]: ...


class RuleDetector:
    """Runs each rule on the snapshots that carry what it reads, in order.

    A new rule is a class with ``reads`` and ``check``, added to ``default_rules`` (or passed
    in); a new collector's readings reach it through ``Snapshot.get``.
    """

    def __init__(
        self, thresholds: RuleThresholds | None = None, rules: list[Rule] | None = None
    ) -> None:
        self.thresholds = thresholds or RuleThresholds()
        self.rules = rules if rules is not None else default_rules(self.thresholds)

    @property
    def reads(self) -> set[str]:
        return {key for rule in self.rules for key in rule.reads}

    def detect(self, snap: Snapshot) -> list[Finding]:
        findings: list[Finding] = []
        for rule in self.rules:
            if any(key in snap.readings for key in rule.reads):
                findings += rule.check(snap)
        return findings


def default_rules(thresholds: RuleThresholds) -> list[Rule]:
    return [XidRule(), GpuRules(thresholds), HostRule(thresholds), WorkerRules(thresholds)]


class XidRule:
    """Fatal XIDs in the kernel log."""

    reads = (XIDS,)

    def check(self, snap: Snapshot) -> list[Finding]:
        return [f for xid in snap.xids for f in _xid(xid)]


class GpuRules:
    """NVML readings; stateful only in the previous counters it diffs against."""

    reads = (GPUS, EXPECTED_GPUS)

    def __init__(self, thresholds: RuleThresholds) -> None:
        self.thresholds = thresholds
        self._previous: dict[int, GpuSample] = {}

    def check(self, snap: Snapshot) -> list[Finding]:
        findings: list[Finding] = []
        for gpu in snap.gpus:
            findings += self._gpu(gpu, self._previous.get(gpu.index))
            if not gpu.lost:
                self._previous[gpu.index] = gpu
        present = {g.index for g in snap.gpus if not g.lost}
        if snap.expected_gpus and len(present) < snap.expected_gpus:
            missing = snap.expected_gpus - len(present)
            findings.append(
                Finding(Reason.GPU_LOST, "node", f"{missing} of {snap.expected_gpus} GPUs missing")
            )
        return findings

    def _gpu(self, gpu: GpuSample, prev: GpuSample | None) -> list[Finding]:
        subject = gpu_subject(gpu)
        if gpu.lost:
            return [Finding(Reason.GPU_LOST, subject, f"GPU {gpu.index} is lost (NVML)")]
        out: list[Finding] = []
        if prev is not None and gpu.ecc_uncorrected_total > prev.ecc_uncorrected_total:
            new = gpu.ecc_uncorrected_total - prev.ecc_uncorrected_total
            out.append(
                Finding(Reason.ECC_UNCORRECTABLE, subject, f"{new} new uncorrectable ECC error(s)")
            )
        if gpu.remap_failure:
            out.append(Finding(Reason.ROW_REMAP_FAILURE, subject, "row remapping failed"))
        if gpu.throttle_reasons & THERMAL_THROTTLE_MASK:
            out.append(
                Finding(
                    Reason.THERMAL_THROTTLE,
                    subject,
                    f"thermal slowdown at {gpu.temperature_c:.0f} C "
                    f"(reasons 0x{gpu.throttle_reasons:x}, SM {gpu.sm_clock_mhz:.0f} MHz)",
                )
            )
        if gpu.throttle_reasons & POWER_BRAKE_MASK:
            out.append(
                Finding(Reason.POWER_THROTTLE, subject, f"power brake at {gpu.power_w:.0f} W")
            )
        if prev is not None:
            replays = gpu.pcie_replays_total - prev.pcie_replays_total
            nvlink = gpu.nvlink_errors_total - prev.nvlink_errors_total
            if replays > self.thresholds.pcie_replays_per_tick or nvlink > 0:
                out.append(
                    Finding(
                        Reason.INTERCONNECT_ERRORS,
                        subject,
                        f"{replays} PCIe replays, {nvlink} NVLink errors since the last tick",
                    )
                )
        return out


class HostRule:
    """Host memory pressure."""

    reads = (HOST,)

    def __init__(self, thresholds: RuleThresholds) -> None:
        self.thresholds = thresholds

    def check(self, snap: Snapshot) -> list[Finding]:
        host = snap.host
        if (
            host is not None
            and host.memory_available_frac < self.thresholds.memory_available_min_frac
        ):
            return [
                Finding(
                    Reason.HOST_PRESSURE,
                    "memory",
                    f"only {host.memory_available_frac:.1%} of host memory available",
                )
            ]
        return []


class WorkerRules:
    """The workers' reports; stateful only in each worker's step-time history."""

    reads = (WORKERS,)

    def __init__(self, thresholds: RuleThresholds) -> None:
        self.thresholds = thresholds
        self._step_times: dict[str, RobustChange] = {}

    def check(self, snap: Snapshot) -> list[Finding]:
        findings: list[Finding] = []
        known = {w.worker for w in snap.workers}
        for worker in snap.workers:
            findings += self._worker(worker, snap.time)
        for gone in self._step_times.keys() - known:
            del self._step_times[gone]
        return findings

    def _worker(self, worker: WorkerState, now: float) -> list[Finding]:
        out: list[Finding] = []
        name = worker.worker
        if worker.loss is not None and not math.isfinite(worker.loss):
            out.append(
                Finding(Reason.NAN_LOSS, name, f"loss is {worker.loss} at step {worker.step}")
            )
        silent = now - worker.last_progress
        if silent > (worker.hang_timeout_s or self.thresholds.hang_timeout_s):
            out.append(
                Finding(Reason.HANG, name, f"no progress for {silent:.0f} s at step {worker.step}")
            )
        for slow in worker.stragglers:
            score = worker.straggler_scores.get(slow)
            detail = f" (score {score:.2f})" if score is not None else ""
            out.append(Finding(Reason.STRAGGLER, slow, f"{slow} is a straggler{detail}"))
        if worker.step_time_s is not None and worker.step_time_s > 0:
            change = self._step_times.setdefault(
                name, RobustChange(threshold=self.thresholds.step_time_z)
            )
            z = change.update(worker.step_time_s)
            if z > change.threshold:
                out.append(
                    Finding(
                        Reason.METRIC_ANOMALY,
                        f"{name}/step_time",
                        f"step time {worker.step_time_s:.3f} s is far above its recent median",
                    )
                )
        return out


def _xid(event: XidEvent) -> list[Finding]:

    if event.info.severity == "info":
        return []  # application-level XIDs: the job's own error, not the node's
    return [
        Finding(
            Reason.XID_ERROR,
            f"pci {event.pci}",
            f"XID {event.info.code}: {event.info.meaning}",
            severity=event.info.severity,
        )
    ]
