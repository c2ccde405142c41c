"""Job throughput: tokens of committed optimizer steps per wall second.

One definition for everything a user reads (live view, ``metrics.jsonl``, the plot,
``summary.json``). Measured on the supervisor's one clock, from the steps the job commits:
a step counts once, when the job first completes it, so steps redone after a restart from
a checkpoint are not counted twice (the time they take is, which is the truth about a
restart). The rate is over a window of recent progress points, so it follows the job;
``mean`` is over the whole run from its first committed step.

Why not the workers' own figures: each worker reports the global batch's tokens divided by
its own step time (``ProgressReport.tokens_per_s``), its *per-worker compute throughput*.
Summing them over the workers counts the same global batch once per worker and leaves out
the time between steps. The reports do say how many tokens one step is
(``tokens_per_s x step_time_s``, the global batch x sequence length the trainer ran), which
is all this needs from them.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW = 20  # progress points


class JobThroughput:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 progress point, got {window}")
        self._recent: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._first: tuple[float, int] | None = None
        self._high: int | None = None
        self.tokens_per_step: float | None = None

    def learn_step_tokens(self, tokens_per_s: float | None, step_time_s: float | None) -> None:
        """Tokens of one optimizer step, from a worker's report."""
        if tokens_per_s and step_time_s:
            self.tokens_per_step = tokens_per_s * step_time_s

    def committed(self, t: float, step: int) -> bool:
        """Step ``step`` completed at ``t`` (seconds on the supervisor's clock); False for a
        step the job had already completed (redone after a restart)."""
        if self._high is not None and step <= self._high:
            return False
        self._high = step
        self._recent.append((t, step))
        if self._first is None:
            self._first = (t, step)
        return True

    def _rate(self, first: tuple[float, int], last: tuple[float, int]) -> float | None:
        seconds, steps = last[0] - first[0], last[1] - first[1]
        if self.tokens_per_step is None or seconds <= 0 or steps <= 0:
            return None
        return steps * self.tokens_per_step / seconds

    def current(self) -> float | None:
        """Tokens/s over the recent window; None until two points are apart in time."""
        if len(self._recent) < 2:
            return None
        return self._rate(self._recent[0], self._recent[-1])

    def mean(self) -> float | None:
        """Tokens/s from the first committed step to the last."""
        if self._first is None or not self._recent:
            return None
        return self._rate(self._first, self._recent[-1])
