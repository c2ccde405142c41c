"""Host collector: CPU, memory, load, disk and network error counters from /proc.

``proc_root`` is injectable so tests (and containers mounting the host's /proc elsewhere)
read a different tree through the same parsing code.
"""

from __future__ import annotations

import logging
from pathlib import Path

from bulkhead.agent.collectors.base import HOST, HostSample

log = logging.getLogger(__name__)


class HostCollector:
    produces = (HOST,)

    def __init__(self, proc_root: Path | str = "/proc") -> None:
        self._root = Path(proc_root)
        self._last_cpu: tuple[float, float] | None = None

    def read(self, now: float) -> dict[str, HostSample]:
        return {HOST: self.collect()}

    def collect(self) -> HostSample:
        return HostSample(
            cpu_busy_frac=self._cpu_busy(),
            memory_available_frac=self._memory_available(),
            load1=self._load1(),
            disk_io_ms_total=self._disk_io_ms(),
            net_errors_total=self._net_errors(),
        )

    def _read(self, name: str) -> str:
        try:
            return (self._root / name).read_text()
        except OSError as exc:
            log.debug("cannot read %s: %s", self._root / name, exc)
            return ""

    def _cpu_busy(self) -> float:
        first = self._read("stat").split("\n", 1)[0].split()
        if not first or first[0] != "cpu":
            return 0.0
        values = [float(v) for v in first[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
        total = sum(values[:8])  # guest time is already inside user/nice
        last, self._last_cpu = self._last_cpu, (total, idle)
        if last is None or total <= last[0]:
            return 0.0
        return max(0.0, 1.0 - (idle - last[1]) / (total - last[0]))

    def _memory_available(self) -> float:
        fields: dict[str, float] = {}
        for line in self._read("meminfo").splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = float(rest.split()[0])
                if len(fields) == 2:
                    break
        total = fields.get("MemTotal", 0.0)
        return fields.get("MemAvailable", total) / total if total else 1.0

    def _load1(self) -> float:
        parts = self._read("loadavg").split()
        return float(parts[0]) if parts else 0.0

    def _disk_io_ms(self) -> float:
        total = 0.0
        for line in self._read("diskstats").splitlines():
            parts = line.split()
            # Field 13 (index 12) is the time spent doing I/Os (ms); skip partitions/loops.
            if len(parts) > 12 and not parts[2].startswith(("loop", "ram")):
                total += float(parts[12])
        return total

    def _net_errors(self) -> int:
        total = 0
        for line in self._read("net/dev").splitlines()[2:]:
            _, _, counters = line.partition(":")
            parts = counters.split()
            if len(parts) >= 12:
                # receive errs, drop; transmit errs, drop
                total += int(parts[2]) + int(parts[3]) + int(parts[10]) + int(parts[11])
        return total
