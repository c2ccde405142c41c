"""``bulkhead`` with a wall clock that is stepped mid-run, as NTP or an admin steps a node's.

CLOCK_JUMPS="rows:seconds,..." moves ``time.time`` (and ``time.time_ns``) of this process by
``seconds`` once the run's metrics.jsonl (under ``--run-dir``) holds ``rows`` steps, each
jump logged on stderr as ``wall clock stepped by +3600 s``. Only this process's wall clock
moves: the worker processes it starts keep the real one, as on another node.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the waiting helper
from waiting import wait_until

_real_time, _real_time_ns = time.time, time.time_ns
_offset_s = 0.0


def _time() -> float:
    return _real_time() + _offset_s


def _time_ns() -> int:
    return _real_time_ns() + int(_offset_s * 1e9)


def _rows(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _step_clock(metrics: Path, jumps: list[tuple[int, float]]) -> None:
    global _offset_s
    for rows, seconds in jumps:
        wait_until(lambda rows=rows: _rows(metrics) >= rows, f"{rows} steps", timeout=600)
        _offset_s += seconds
        sys.stderr.write(f"clock_jump: wall clock stepped by {seconds:+g} s\n")
        sys.stderr.flush()


def main() -> None:
    # Before anything of ours is imported: `from time import time` then binds the stepped one.
    time.time, time.time_ns = _time, _time_ns
    args = sys.argv[1:]
    metrics = Path(args[args.index("--run-dir") + 1]) / "metrics.jsonl"
    jumps = [
        (int(rows), float(seconds))
        for rows, seconds in (j.split(":") for j in os.environ["CLOCK_JUMPS"].split(","))
    ]
    threading.Thread(target=_step_clock, args=(metrics, jumps), daemon=True).start()
    from bulkhead.cli.main import main as bulkhead

    sys.argv = ["bulkhead", *args]
    bulkhead()


if __name__ == "__main__":
    main()
