"""k-of-n persistence: a finding escalates to a problem only if seen in k of the last n ticks.

One-tick blips (a single throttled sample, a transient counter glitch) never reach the
Node; a reason configured with k = n = 1 (a fatal XID) escalates on first sight.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bulkhead.agent.problems import Finding


@dataclass(frozen=True)
class Window:
    k: int = 1
    n: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.k <= self.n:
            raise ValueError(f"persistence needs 1 <= k <= n, got k={self.k} n={self.n}")


class Persistence:
    """Feed every tick's findings; get back the ones that have persisted."""

    def __init__(self, windows: dict[str, Window], default: Window | None = None) -> None:
        self._windows = windows
        self._default = default or Window()
        self._history: dict[tuple[str, str], deque[bool]] = {}
        self._latest: dict[tuple[str, str], Finding] = {}

    def window(self, reason: str) -> Window:
        return self._windows.get(reason, self._default)

    def update(self, findings: list[Finding]) -> list[Finding]:
        seen = {f.key: f for f in findings}
        self._latest.update(seen)
        for key in seen.keys() | self._history.keys():
            n = self.window(key[0]).n
            history = self._history.setdefault(key, deque(maxlen=n))
            history.append(key in seen)
        persistent: list[Finding] = []
        for key, history in list(self._history.items()):
            if not any(history):
                del self._history[key]  # fully healthy for n ticks: forget it
                self._latest.pop(key, None)
                continue
            if sum(history) >= self.window(key[0]).k:
                persistent.append(self._latest[key])
        return persistent
