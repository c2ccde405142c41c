"""Live progress of a local run (rich): step, loss, validation loss, tokens/s, generation,
workers, recoveries and the parallel plan of the generation (pipelines, experts per worker).

On a terminal a live panel is redrawn a few times a second and events scroll above it;
elsewhere (CI logs, pipes) events and a progress line every few steps are printed plainly.
"""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.table import Table

from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.local.rundir import EventRow, MetricRow

_STYLE = {"Running": "green", "Recovering": "yellow", "Failed": "red", "Succeeded": "bold green"}


class LiveView:
    def __init__(
        self, job: str, total_steps: int, console: Console | None = None, enabled: bool = True
    ) -> None:
        self.job = job
        self.total_steps = total_steps
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.status: TrainingJobStatus | None = None
        self.last: MetricRow | None = None
        self.evaluated: MetricRow | None = None  # the newest row with a validation loss
        self._live: Live | None = None
        self._printed_step = -1
        self.plan: list[str] = []  # the newest PlanApplied Event's lines

    def __enter__(self) -> LiveView:
        if self.enabled and self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)
            self._live = None

    def on_status(self, status: TrainingJobStatus) -> None:
        self.status = status
        self._refresh()

    def on_metric(self, row: MetricRow) -> None:
        self.last = row
        if row.val_loss is not None:
            self.evaluated = row
        if self._live is None and self.enabled and row.step // 10 != self._printed_step // 10:
            self._printed_step = row.step
            self.console.print(self._line(), highlight=False)
        self._refresh()

    def on_event(self, event: EventRow) -> None:
        if event.reason == "PlanApplied":
            self.plan = event.message.split(" | ")
            self._refresh()
        if not self.enabled or (event.reason == "MembershipPublished" and self._live is None):
            return
        style = "yellow" if event.warning else "cyan"
        self.console.print(
            f"[dim]{event.t:7.1f}s[/] [{style}]{event.reason}[/] {event.message}", highlight=False
        )

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def _line(self) -> str:
        row, status = self.last, self.status
        parts = [f"step {row.step + 1 if row else 0}/{self.total_steps}"]
        if row and row.loss is not None:
            parts.append(f"loss {row.loss:.4f}")
        if self.evaluated is not None:
            parts.append(f"val {self.evaluated.val_loss:.4f}")
        if row and row.tokens_per_s:
            parts.append(f"{row.tokens_per_s:,.0f} job tok/s")
        if status:
            parts.append(f"gen {status.membership.generation}")
            parts.append(f"workers {status.workers}")
            parts.append(f"recoveries {len(status.recoveries)}")
        return "  ".join(parts)

    def _render(self) -> Table:
        row, status = self.last, self.status
        phase = status.phase if status else "Pending"
        table = Table(title=f"bulkhead run: {self.job}", show_header=False, expand=False)
        table.add_column(style="bold")
        table.add_column()
        done = row.step + 1 if row else 0
        table.add_row("phase", f"[{_STYLE.get(phase, 'white')}]{phase}[/]")
        table.add_row("step", f"{done}/{self.total_steps}")
        table.add_row("loss", f"{row.loss:.4f}" if row and row.loss is not None else "-")
        if self.evaluated is not None:
            table.add_row(
                "val loss", f"{self.evaluated.val_loss:.4f} (after step {self.evaluated.step + 1})"
            )
        # The job's rate (committed steps per wall second), then each worker's compute rate.
        table.add_row(
            "job tokens/s", f"{row.tokens_per_s:,.0f}" if row and row.tokens_per_s else "-"
        )
        if row and row.worker_tokens_per_s:
            table.add_row("per-worker compute tokens/s", f"{row.worker_tokens_per_s:,.0f}")
        if status:
            table.add_row("generation", str(status.membership.generation))
            table.add_row("workers", status.workers)
            seconds = [f"{r.seconds:.2f}s" for r in status.recoveries if r.seconds is not None]
            table.add_row("recoveries", f"{len(status.recoveries)} {' '.join(seconds)}".strip())
            table.add_row("restarts", str(status.restarts))
        if self.plan:
            table.add_row("plan", "\n".join(self.plan))
        return table
