"""XID collector: NVIDIA XID reports from the kernel log, classified by the XID table.

Sources: ``/dev/kmsg`` (the kernel ring buffer, one record per read) or a log file that is
followed like ``tail -F`` (kern.log; also what tests write to). Both start at the end: XIDs
logged before the agent started were handled by the previous agent or predate this boot.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Protocol

from bulkhead.agent.collectors.base import XIDS
from bulkhead.agent.xid import XidEvent, parse_xid

log = logging.getLogger(__name__)

MAX_LINES_PER_TICK = 10_000  # a log storm must not stall the tick


class LineSource(Protocol):
    def read_lines(self) -> list[str]: ...


class KmsgSource:
    """``/dev/kmsg``: records ``prio,seq,usec,flags;message``; needs CAP_SYSLOG or root."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)

    def read_lines(self) -> list[str]:
        lines: list[str] = []
        while len(lines) < MAX_LINES_PER_TICK:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before we read it: skip ahead
                    log.warning("kernel log records were overwritten before being read")
                    continue
                raise
            if not record:
                break
            text = record.decode("utf-8", errors="replace")
            lines.append(text.split(";", 1)[-1].strip())
        return lines


class FileFollowSource:
    """Follows a text log file from its end, reopening it after rotation or truncation."""

    def __init__(self, path: Path | str) -> None:
        self._path = Path(path)
        self._inode: int | None = None
        self._offset = 0
        self._partial = ""
        if self._path.exists():
            stat = self._path.stat()
            self._inode, self._offset = stat.st_ino, stat.st_size

    def read_lines(self) -> list[str]:
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            return []
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._inode, self._offset, self._partial = stat.st_ino, 0, ""
        if stat.st_size == self._offset:
            return []
        with self._path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        *lines, self._partial = text.split("\n")
        return lines[-MAX_LINES_PER_TICK:]


class XidCollector:
    """XID events logged since the previous tick."""

    produces = (XIDS,)

    def __init__(self, source: LineSource) -> None:
        self._source = source

    def read(self, now: float) -> dict[str, tuple[XidEvent, ...]]:
        return {XIDS: tuple(self.collect())}

    def collect(self) -> list[XidEvent]:
        events = [e for e in map(parse_xid, self._source.read_lines()) if e is not None]
        for event in events:
            log.log(
                logging.ERROR if event.info.severity == "critical" else logging.INFO,
                "XID %d on %s (%s): %s",
                event.info.code,
                event.pci,
                event.info.severity,
                event.info.meaning,
            )
        return events


def open_source(path: str) -> LineSource | None:
    """The kernel log at ``path`` ('' = off); /dev/kmsg is read as records, others followed."""
    if not path:
        return None
    if path == "/dev/kmsg":
        return KmsgSource(path)
    return FileFollowSource(path)
