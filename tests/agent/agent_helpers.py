"""Helpers for the agent tests: build the production agent around replay sources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


def asd_path() -> Path:
    """The ASD development set (``shared/data/asd/asd.npz`` above the checkout), or fail."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data" / "asd" / "asd.npz"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("the ASD dataset is missing: expected shared/data/asd/asd.npz above")


def planted_dataset(folder: Path, series: int = 2, seed: int = 0) -> Path:
    """A small labelled dataset in the ASD layout: noisy correlated metrics with a planted
    shift of metrics 2 and 3 per series' test part, and its interpretation labels."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    labels = folder / "interpretation_label"
    labels.mkdir(parents=True)
    for s in range(1, series + 1):

        def part(start: int, length: int) -> np.ndarray:
            # the test part follows the train part in time, as in ASD (its cycle goes on)
            load = 0.5 + 0.2 * np.sin(np.arange(start, start + length) / 30.0)
            return np.clip(
                np.stack([load, 1 - load, load * 0.8, load * 0.5, rng.random(length) * 0.1], 1)
                + rng.normal(0, 0.01, (length, 5)),
                0,
                1,
            ).astype(np.float32)

        train, test = part(0, 1500), part(1500, 600)
        label = np.zeros(600, dtype=np.int64)
        test[300:340, 2] += 0.3
        test[300:340, 3] -= 0.2
        label[300:340] = 1
        arrays |= {f"srv-{s}_train": train, f"srv-{s}_test": test, f"srv-{s}_test_label": label}
        (labels / f"srv-{s}.txt").write_text("300-339:3,4\n")
    path = folder / "planted.npz"
    np.savez(path, **arrays)
    return path
