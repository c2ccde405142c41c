"""Collectors: each reads one source (NVML, kernel log, /proc, worker reports) per tick.

Every collector has one small interface, ``collect(now) -> <its sample type>``, and takes its
source as a constructor argument, so tests replay recorded traces through the same code
path that production runs against the real device or file.
"""

from bulkhead.agent.collectors.base import GpuSample, HostSample, Snapshot, WorkerState

__all__ = ["GpuSample", "HostSample", "Snapshot", "WorkerState"]
