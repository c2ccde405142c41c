"""Check 4 of ``bench/gpu_check.py``: the abort monitor ends an NCCL world of one rank.

In a process of its own (a hang there must not hang the check; the record of the stage it
reached comes back either way): a world of one rank forms on NCCL with the recovery
environment (``device.activate``) and trains a step; the main thread blocks behind a
receive no rank will ever send; ``AbortMonitor`` aborts the world from its side thread
(``World.abort``), and the main thread must hold the error within ``ABORT_LIMIT_S`` of the
abort; a new world then forms, adopts the state and trains a step. On the CPU the world is
gloo: an abort cannot interrupt a gloo wait (pytorch#130345; the trainer cuts a failed
gloo world's connections instead, which check 2 exercises), so that part is reported as
not applicable and the rest runs.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _engine_runs import dataset_for, engine_config, peak_memory, process_context, reset_peak_memory
from _gpu_options import Options

from bulkhead.trainer.engine.device import NCCL_RECOVERY_ENV, AbortMonitor, activate, pick_device
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.world import CollectiveError, open_world
from bulkhead.trainer.parallel.plan import make_plan

ABORT_LIMIT_S = 1.0


def _abort_child(cpu: bool, model: dict[str, Any], out_path: str) -> None:
    """Runs in its own process (a hang there must not hang the check)."""
    record: dict[str, Any] = {"stage": "starting"}

    def save(stage: str, **fields: Any) -> None:
        record.update(fields, stage=stage)
        Path(out_path).write_text(json.dumps(record))

    device = pick_device(0, cuda_available=False if cpu else None)
    activate(device)  # NCCL: the recovery environment
    reset_peak_memory(device.device)
    save("forming", backend=device.backend,
         environment={k: os.environ.get(k) for k in NCCL_RECOVERY_ENV})  # fmt: skip
    cfg = engine_config(0, 1, 1, 0, model)
    dataset = dataset_for(cfg)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60))
    abort_now = threading.Event()
    started = time.monotonic()
    world = open_world(1, 0, ["w0"], ["w0"], store, device, 60,
                       should_abandon=abort_now.is_set, abandon_after_s=0.5)  # fmt: skip
    engine = build_engine(make_plan(1, ["w0"], ["w0"], cfg), world, cfg)
    engine.adopt(None)
    first = engine.step(dataset)  # the communicator exists once a collective ran
    save("formed", formed_s=time.monotonic() - started, first_loss=first.loss,
         world_backend=str(dist.get_backend()))  # fmt: skip
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        world.abort("gpu check: the monitor aborts the world")

    monitor = AbortMonitor(abort_now.is_set, abort).start()
    if device.backend == "nccl":
        pending = torch.zeros(1, device=device.device)
        threading.Timer(0.5, abort_now.set).start()  # the control plane's part
        error: str | None = None
        collective_error = False
        unblocked: float | None = None
        try:
            # As inside a step: library waits under world.guard, which turns a
            # communication failure into the CollectiveError the runtime recovers from.
            with world.guard("the pending receive"):
                # A receive from this rank itself that no send matches: it never completes.
                # The process group's own call (what irecv makes), so that no version's
                # wrapper check on the source rank stands in the way.
                work = dist.group.WORLD.recv([pending], 0, 0)
                save("waiting")
                work.wait()  # the stream waits for the receive...
                float(pending.item())  # ...and the main thread blocks on that stream
            unblocked = time.monotonic()
            world.all_reduce(torch.zeros(1, device=device.device))  # the trainer's next wait
        except Exception as exc:  # whatever it is, the record says
            error = f"{type(exc).__name__}: {exc}"[:400]
            collective_error = isinstance(exc, CollectiveError)
        returned = time.monotonic()
        monitor.stop()
        abort_t = aborted_at[0] if aborted_at else None
        # The main thread must still have been blocked when the monitor aborted.
        blocked = abort_t is not None and (unblocked or returned) >= abort_t
        latency = returned - abort_t if abort_t is not None else None
        in_time = latency is not None and latency <= ABORT_LIMIT_S
        save(
            "waited",
            error=error,
            collective_error=collective_error,
            blocked_until_abort=blocked,
            unblocked_after_abort_s=(unblocked or returned) - abort_t if blocked else None,
            error_after_abort_s=latency,
            interrupted=collective_error and blocked and in_time,
        )
    else:
        abort_now.set()
        monitor.fired.wait(5)
        monitor.stop()
        save("aborted", interrupted=None, monitor_fired=monitor.fired.is_set(),
             not_applicable="gloo: an abort from another thread cannot interrupt a pending "
             "gloo wait (pytorch#130345); the trainer cuts a failed gloo world's "
             "connections instead (check 2's kill)")  # fmt: skip
    held = engine.held_state()
    world.close()
    reformed = time.monotonic()
    world = open_world(2, 0, ["w0"], ["w0"], store, device, 60)
    engine = build_engine(make_plan(2, ["w0"], ["w0"], cfg), world, cfg)
    adoption = engine.adopt(held)
    result = engine.step(dataset)
    world.close()
    save("done", reformed_s=time.monotonic() - reformed, adoption=adoption.source,
         step_after=result.step, loss_after=result.loss,
         peak_memory=peak_memory(device.device))  # fmt: skip


def check_nccl_abort(opts: Options, timeout_s: float = 90) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-gpu-check-abort-") as tmp:
        path = Path(tmp, "abort.json")
        args = (opts.cpu, opts.small, str(path))
        proc = process_context().Process(target=_abort_child, args=args)
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
        record = json.loads(path.read_text()) if path.exists() else {"stage": "not started"}
    record["exit_code"] = proc.exitcode
    stepped = record.get("stage") == "done" and record.get("step_after") == 1
    interrupted = record.get("interrupted")
    environment = record.get("environment", {})
    # On NCCL the world must run with the recovery environment (activate sets it).
    recovery_env = record.get("backend") != "nccl" or all(
        environment.get(k) == v for k, v in NCCL_RECOVERY_ENV.items()
    )
    record["passed"] = bool(
        stepped and proc.exitcode == 0 and interrupted is not False and recovery_env
    )
    if record["stage"] != "done":
        record["reason"] = f"stopped at stage {record['stage']!r} (exit code {proc.exitcode})"
    return record
