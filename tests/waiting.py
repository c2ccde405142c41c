"""The one way tests wait: poll a condition until it holds, with a deadline (never a bare sleep).

``wait_until`` blocks; ``until`` is the same for a coroutine on an event loop that must keep
running meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T],
    what: str = "condition",
    timeout: float = 60.0,
    every: float = 0.02,
    retry_errors: bool = False,
) -> T:
    """Poll ``check`` until it returns something truthy and return that; fail naming ``what``.

    ``retry_errors`` treats an exception from ``check`` as "not yet" (for objects that may not
    exist yet); the last one is quoted if the deadline passes.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
        except Exception as exc:
            if not retry_errors:
                raise
            last_error = exc
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            suffix = f" (last error: {last_error})" if last_error else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{suffix}")
        time.sleep(every)


async def until(
    check: Callable[[], object], what: str = "condition", timeout: float = 20.0
) -> None:
    """``wait_until`` for asyncio tests: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)
