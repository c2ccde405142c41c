"""The consumed-samples log: one JSON line per committed step, written by rank 0.

Lines are ``{"step", "generation", "world_size", "positions": [first, end]}`` (the step's
stream positions are the range [first, end)). The log must describe the state that
survives: when a rank becomes rank 0 after a reconfiguration, ``reconcile`` drops steps the
surviving state does not contain (a dead coordinator may have logged a step no survivor
committed) and fills steps the dead one committed but never logged.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from bulkhead.trainer.data import step_positions

log = logging.getLogger(__name__)


class SamplesLog:
    def __init__(self, path: Path, global_batch_size: int) -> None:
        self.path = path
        self.global_batch_size = global_batch_size

    def append(self, step: int, generation: int, world_size: int, **extra: Any) -> None:
        self._write_lines([self._entry(step, generation, world_size, **extra)], append=True)

    def read(self) -> list[dict[str, Any]]:
        """Every well-formed entry (a torn last line from a killed writer is skipped)."""
        return self._read()[0]

    def _read(self) -> tuple[list[dict[str, Any]], bool]:
        """(entries, whether the file holds exactly those entries and nothing torn)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return [], True
        entries = []
        clean = text == "" or text.endswith("\n")
        for line in text.splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                clean = False
        return entries, clean

    def reconcile(self, completed_steps: int, generation: int, world_size: int) -> None:
        """Make the log list exactly the steps ``0 .. completed_steps - 1`` once each."""
        entries, clean = self._read()
        kept = [e for e in entries if e.get("step", completed_steps) < completed_steps]
        logged = {e["step"] for e in kept}
        missing = [s for s in range(completed_steps) if s not in logged]
        kept.extend(self._entry(s, generation, world_size, recovered=True) for s in missing)
        if clean and len(kept) == len(entries) and not missing:
            return
        log.info(
            "samples log: reconciled to %d steps (%d dropped, %d filled)",
            completed_steps,
            len(entries) - (len(kept) - len(missing)),
            len(missing),
        )
        kept.sort(key=lambda e: e["step"])
        self._write_lines(kept, append=False)

    def _entry(self, step: int, generation: int, world_size: int, **extra: Any) -> dict[str, Any]:
        positions = step_positions(step, self.global_batch_size)
        return {
            "step": step,
            "generation": generation,
            "world_size": world_size,
            "positions": [positions.start, positions.stop],
            **extra,
        }

    def _write_lines(self, entries: list[dict[str, Any]], append: bool) -> None:
        data = "".join(json.dumps(e) + "\n" for e in entries).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            # One write on an O_APPEND descriptor: lines from one writer never interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
