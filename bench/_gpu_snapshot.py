"""Check 3 of ``bench/gpu_check.py``: snapshots of the trainer's state from GPU memory.

The state is the engine's held keys (as the runtime snapshots them). Timed, median of
``opts.repeats``: ``CheckpointEngine.snapshot`` from GPU memory into shared memory (what
training blocks for; the sidecar, a real one in this process, seals each snapshot before
the next) and ``CheckpointEngine.restore`` back into the live GPU tensors (verified), beside
one raw device-to-host / host-to-device copy of the same byte count to and from pinned
(page-locked) and pageable host memory. Passes when the restored state equals the snapshot
bit for bit; the timings are reported, not judged.
"""

from __future__ import annotations

import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _engine_runs import dataset_for, engine_config, solo_world, sync
from _gpu_options import Options

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.checkpoint.sidecar import Sidecar


def median_s(action: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        action()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def check_snapshot(opts: Options) -> dict[str, Any]:
    device = opts.device()
    dev = device.device
    cfg = engine_config(0, 1, 1, 0, opts.big)
    world, engine = solo_world(cfg, device)
    shm = Path("/dev/shm") / f"bulkhead-gpu-check-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    sidecar = Sidecar(shm, shm / "checkpointd.sock", poll_interval=0.2)
    sidecar.start()
    ckpt = CheckpointEngine(CheckpointSettings(job="gpu-check", shm_dir=shm))
    try:
        engine.step(dataset_for(cfg))  # Adam's state exists and is not zero
        # What the runtime snapshots: the engine's held keys (views of the live tensors).
        state = engine.held_state().to_snapshot()
        tensors = list(state["keys"].values())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        expected = {k: t.detach().cpu().clone() for k, t in state["keys"].items()}
        blocking = []
        for step in range(1, opts.repeats + 1):
            sync(dev)
            blocking.append(ckpt.snapshot(step, state).blocking_s)
            # Sealed before the next one, as with a snapshot interval longer than a seal:
            # the next snapshot then never waits for the sidecar to free a slot.
            ckpt.sidecar.flush("sealed", 120)
        # Restore into the live GPU tensors after overwriting them.
        for t in tensors:
            t.zero_()

        def restore() -> None:
            restored = ckpt.restore(into=state)
            if restored is None:
                raise RuntimeError("no snapshot could be restored")

        restore_s = median_s(restore, dev, opts.repeats)
        equal = all(torch.equal(state["keys"][k].cpu(), v) for k, v in expected.items())
        flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        host = {"pageable": torch.empty(nbytes, dtype=torch.uint8)}
        if device.is_cuda:
            host["pinned"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        raw = {}
        for kind, buf in host.items():
            raw[f"d2h_{kind}_s"] = median_s(lambda b=buf: b.copy_(flat), dev, opts.repeats)
            raw[f"h2d_{kind}_s"] = median_s(lambda b=buf: flat.copy_(b), dev, opts.repeats)
        best_d2h = raw.get("d2h_pinned_s", raw["d2h_pageable_s"])
        best_h2d = raw.get("h2d_pinned_s", raw["h2d_pageable_s"])
        snap_s = statistics.median(blocking)
        return {
            "bytes": nbytes,
            "tensors": len(tensors),
            "snapshot_blocking_s": snap_s,
            "restore_s": restore_s,
            **raw,
            "snapshot_vs_raw_d2h": snap_s / best_d2h,
            "restore_vs_raw_h2d": restore_s / best_h2d,
            "snapshot_gb_per_s": nbytes / snap_s / 1e9,
            "restore_gb_per_s": nbytes / restore_s / 1e9,
            "host_memory": "shared memory (mmap of /dev/shm), pageable: the checkpoint "
            "engine does not pin it",
            "restored_equal": equal,
            "passed": equal,
        }
    finally:
        ckpt.close()
        sidecar.stop(drain_timeout=10)
        shutil.rmtree(shm, ignore_errors=True)
        world.close()
