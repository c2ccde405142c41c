"""Helpers for the agent tests: build the production agent around replay sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bulkhead.agent.replay import ReplayGpuSource, ReplayLineSource, SimClock
from bulkhead.agent.service import Built, Sources, build
from bulkhead.agent.settings import AgentSettings

TOKEN = "s3cret-test-token"
# Test traces tick once per simulated second; a hang and the healthy period fit in them.
TEST_SETTINGS: dict[str, Any] = {
    "node_name": "test-node",
    "hang_timeout_s": 10,
    "healthy_period_s": 10,
    "report_token": TOKEN,
    "kubernetes": False,
}


@dataclass
class Rig:
    built: Built
    gpu: ReplayGpuSource
    lines: ReplayLineSource
    clock: SimClock


def rig(api: Any = None, **overrides: Any) -> Rig:
    gpu, lines, clock = ReplayGpuSource(), ReplayLineSource(), SimClock()
    settings = AgentSettings(**{**TEST_SETTINGS, **overrides})
    built = build(settings, Sources(gpu=gpu, kernel_log=lines, api=api, host=False), clock=clock)
    return Rig(built, gpu, lines, clock)
