"""The samples collectors produce, the ``Collector`` protocol, and the per-tick snapshot
the detectors consume (readings keyed by what each collector produces)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

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
    hang_timeout_s: float | None = None  # the job's, when the worker says


# The readings of the built-in collectors, by the key each produces (a collector's
# ``produces``, a detector rule's ``reads``). A new collector adds its own key; nothing here
# has to change for it.
GPUS = "gpus"  # tuple[GpuSample, ...]
EXPECTED_GPUS = "expected_gpus"  # int: GPUs seen at start-up
XIDS = "xids"  # tuple[XidEvent, ...]
HOST = "host"  # HostSample | None
WORKERS = "workers"  # tuple[WorkerState, ...]


class Collector(Protocol):
    """A source of readings: registers the keys it produces, reads them once per tick."""

    produces: tuple[str, ...]

    def read(self, now: float) -> Mapping[str, Any]:
        """This tick's readings, one per key of ``produces``."""
        ...


class Snapshot:
    """Everything observed at one tick: each collector's readings under the keys it produces.

    ``Snapshot(time, readings)`` or ``Snapshot(time, gpus=..., host=...)``. The properties
    are typed views of the built-in keys; other keys are read with ``get``.
    """

    __slots__ = ("readings", "time")

    def __init__(
        self, time: float, readings: Mapping[str, Any] | None = None, **named: Any
    ) -> None:
        self.time = time
        self.readings: Mapping[str, Any] = MappingProxyType({**(readings or {}), **named})

    def get(self, key: str, default: Any = None) -> Any:
        return self.readings.get(key, default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Snapshot) and (self.time, dict(self.readings)) == (
            other.time,
            dict(other.readings),
        )

    def __hash__(self) -> int:
        return hash(self.time)

    def __repr__(self) -> str:
        return f"Snapshot(time={self.time!r}, readings={dict(self.readings)!r})"

    @property
    def gpus(self) -> tuple[GpuSample, ...]:
        return tuple(self.get(GPUS, ()))

    @property
    def expected_gpus(self) -> int:
        return int(self.get(EXPECTED_GPUS, 0))

    @property
    def xids(self) -> tuple[XidEvent, ...]:
        return tuple(self.get(XIDS, ()))

    @property
    def host(self) -> HostSample | None:
        return self.get(HOST)

    @property
    def workers(self) -> tuple[WorkerState, ...]:
        return tuple(self.get(WORKERS, ()))
