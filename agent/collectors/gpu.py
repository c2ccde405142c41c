"""GPU collector: NVML readings per device, behind a ``GpuSource`` so traces can be replayed.

``NvmlSource`` is the production source (nvidia-ml-py). A metric the device does not
support (NVML_ERROR_NOT_SUPPORTED, e.g. ECC on consumer boards) is left at its default, and
a device that answers GPU_IS_LOST is reported as ``lost`` instead of crashing the agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from bulkhead.agent.collectors.base import EXPECTED_GPUS, GPUS, GpuSample

log = logging.getLogger(__name__)
T = TypeVar("T")

THERMAL_THROTTLE_MASK = 0x08 | 0x20 | 0x40  # HW slowdown, SW thermal, HW thermal
POWER_BRAKE_MASK = 0x80  # HW power brake (external power-supply signal)


class GpuSource(Protocol):
    def read(self) -> list[GpuSample]: ...


class GpuCollector:
    """Reads every GPU each tick; ``expected`` is the device count seen at start-up."""

    produces = (GPUS, EXPECTED_GPUS)

    def __init__(self, source: GpuSource) -> None:
        self._source = source
        self.expected = 0

    def read(self, now: float) -> dict[str, Any]:
        gpus = tuple(self.collect())
        return {GPUS: gpus, EXPECTED_GPUS: self.expected}

    def collect(self) -> list[GpuSample]:
        samples = self._source.read()
        self.expected = max(self.expected, len(samples))
        return samples


class TraceGpuSource:
    """Replays a recorded trace: one list of samples per tick, the last one repeated."""

    def __init__(self, trace: Sequence[list[GpuSample]]) -> None:
        if not trace:
            raise ValueError("a GPU trace needs at least one tick")
        self._trace = list(trace)
        self._tick = 0

    def read(self) -> list[GpuSample]:
        samples = self._trace[min(self._tick, len(self._trace) - 1)]
        self._tick += 1
        return list(samples)


class NvmlSource:
    """The real GPUs through NVML. Raises at construction when NVML is unavailable."""

    def __init__(self) -> None:
        import pynvml  # optional dependency: only nodes with the NVIDIA driver need it

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._count = pynvml.nvmlDeviceGetCount()
        log.info("NVML initialised: %d GPU(s)", self._count)

    def _optional(self, call: Callable[[], T], default: T) -> T:
        try:
            return call()
        except self._nvml.NVMLError_NotSupported:
            return default

    def read(self) -> list[GpuSample]:
        return [self._read_one(i) for i in range(self._count)]

    def _read_one(self, index: int) -> GpuSample:
        nv = self._nvml
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            return self._sample(index, handle)
        except nv.NVMLError_GpuIsLost:
            log.error("GPU %d is lost (NVML_ERROR_GPU_IS_LOST)", index)
            return GpuSample(index=index, lost=True)
        except nv.NVMLError as exc:
            # Any other failure to reach the device is also a lost GPU from training's view.
            log.error("GPU %d unreadable: %s", index, exc)
            return GpuSample(index=index, lost=True)

    def _sample(self, index: int, handle: Any) -> GpuSample:
        nv = self._nvml
        opt = self._optional
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        remap = opt(lambda: nv.nvmlDeviceGetRemappedRows(handle), (0, 0, 0, 0))
        return GpuSample(
            index=index,
            uuid=str(nv.nvmlDeviceGetUUID(handle)),
            utilization_pct=float(nv.nvmlDeviceGetUtilizationRates(handle).gpu),
            memory_used_bytes=float(memory.used),
            memory_total_bytes=float(memory.total),
            temperature_c=float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
            power_w=opt(lambda: nv.nvmlDeviceGetPowerUsage(handle), 0) / 1000.0,
            sm_clock_mhz=float(opt(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM), 0)),
            throttle_reasons=int(
                opt(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle), 0)
            ),
            ecc_corrected_total=int(opt(lambda: self._ecc(handle, corrected=True), 0)),
            ecc_uncorrected_total=int(opt(lambda: self._ecc(handle, corrected=False), 0)),
            retired_pages_total=int(opt(lambda: self._retired_pages(handle), 0)),
            remapped_rows_pending=bool(remap[2]),
            remap_failure=bool(remap[3]),
            pcie_replays_total=int(opt(lambda: nv.nvmlDeviceGetPcieReplayCounter(handle), 0)),
            nvlink_errors_total=self._nvlink_errors(handle),
        )

    def _ecc(self, handle: Any, corrected: bool) -> int:
        nv = self._nvml
        kind = (
            nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
            if corrected
            else nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        )
        return int(nv.nvmlDeviceGetTotalEccErrors(handle, kind, nv.NVML_VOLATILE_ECC))

    def _retired_pages(self, handle: Any) -> int:
        nv = self._nvml
        causes = (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        return sum(len(nv.nvmlDeviceGetRetiredPages(handle, cause)) for cause in causes)

    def _nvlink_errors(self, handle: Any) -> int:
        nv = self._nvml
        counters = (
            nv.NVML_NVLINK_ERROR_DL_REPLAY,
            nv.NVML_NVLINK_ERROR_DL_RECOVERY,
            nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
        )
        total = 0
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                total += sum(nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, c) for c in counters)
            except nv.NVMLError:
                # Links past the device's count (or without NVLink) answer an error: stop.
                break
        return total


def no_gpus() -> GpuSource:
    """A source for nodes without GPUs (or without the driver): always empty."""

    class _Empty:
        def read(self) -> list[GpuSample]:
            return []

    return _Empty()


def open_source(mode: str) -> GpuSource:
    """``nvml``: NVML or fail; ``auto``: NVML if it loads, else no GPUs; ``none``: no GPUs."""
    if mode == "none":
        return no_gpus()
    try:
        return NvmlSource()
    except Exception as exc:
        if mode == "nvml":
            raise RuntimeError(f"NVML is unavailable: {exc}") from exc
        log.warning("NVML unavailable (%s); GPU monitoring is off", exc)
        return no_gpus()
