"""The samples collectors produce and the per-tick snapshot the detectors consume."""

from __future__ import annotations

from dataclasses import dataclass, field

from bulkhead.agent.xid import XidEvent


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one tick. Counters are cumulative since driver load (detectors diff them)."""

    index: int
    uuid: str = ""
    lost: bool = False  # NVML answered GPU_IS_LOST (or the device vanished)
    utilization_pct: float = 0.0
    memory_used_bytes: float = 0.0
    memory_total_bytes: float = 0.0
    temperature_c: float = 0.0
    power_w: float = 0.0
    sm_clock_mhz: float = 0.0
    throttle_reasons: int = 0  # NVML clocksThrottleReasons bit mask
    ecc_corrected_total: int = 0
    ecc_uncorrected_total: int = 0
    retired_pages_total: int = 0
    remapped_rows_pending: bool = False
    remap_failure: bool = False
    pcie_replays_total: int = 0
    nvlink_errors_total: int = 0


@dataclass(frozen=True)
class HostSample:
    cpu_busy_frac: float = 0.0
    memory_available_frac: float = 1.0
    load1: float = 0.0
    disk_io_ms_total: float = 0.0
    net_errors_total: int = 0


@dataclass
class WorkerState:
    """What the agent knows about one training worker on this node (from its reports)."""

    worker: str
    step: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    last_report: float = 0.0
    last_progress: float = 0.0  # when ``step`` last advanced
    stragglers: list[str] = field(default_factory=list)  # workers this one reported as slow
    straggler_scores: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """Everything observed at one tick."""

    time: float
    gpus: tuple[GpuSample, ...] = ()
    expected_gpus: int = 0
    xids: tuple[XidEvent, ...] = ()
    host: HostSample | None = None
    workers: tuple[WorkerState, ...] = ()
