"""Fixtures for the checkpoint engine tests: private shm directories and sidecars."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bulkhead.trainer.checkpoint.sidecar import Sidecar

torch.set_num_threads(1)


@pytest.fixture
def shm_factory() -> Iterator:
    """Makes fresh directories in /dev/shm (memory-backed, like the pod's emptyDir)."""
    made: list[Path] = []

    def make() -> Path:
        path = Path("/dev/shm") / f"bulkhead-test-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir(shm_factory) -> Path:
    return shm_factory()


@pytest.fixture
def sidecar_factory() -> Iterator:
    """In-process sidecars (real threads, sockets and files), stopped at teardown."""
    started: list[Sidecar] = []

    def make(shm_dir: Path, **kwargs) -> Sidecar:
        kwargs.setdefault("poll_interval", 0.2)
        sidecar = Sidecar(shm_dir, shm_dir / "checkpointd.sock", **kwargs)
        sidecar.start()
        started.append(sidecar)
        return sidecar

    yield make
    for sidecar in started:
        sidecar.stop(drain_timeout=10)
