"""Which device and communication backend a trainer process uses, and the CUDA specifics.

A worker pod with G GPUs runs one trainer process per GPU; process ``local_rank`` takes
``cuda:<local_rank>`` and NCCL. Without CUDA the process trains on the CPU with gloo. The
choice is made once per process, from the device, never from a setting that could
disagree with it.

On CUDA, a failed generation must not leave the main thread stuck inside NCCL and must not
let NCCL's watchdog kill the process (the survivors' state lives in it): the environment
below keeps the watchdog from tearing the process down, and ``AbortMonitor`` aborts the
generation's communicators from a side thread when the runtime says the generation is over
(a newer membership, a peer failure), so the blocked collective returns with an error.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# NCCL settings for in-process recovery: errors surface as exceptions in the process
# instead of the watchdog aborting it, and the asynchronous error handling does not kill it.
NCCL_RECOVERY_ENV: Mapping[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # skip cleanup; never tear the process down
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # the heartbeat monitor would kill a hung process
}


@dataclass(frozen=True)
class DeviceChoice:
    """The device a trainer process computes on and the c10d backend of its worlds."""

    device: torch.device
    backend: str  # "gloo" | "nccl"
    local_rank: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        return f"{self.device} ({self.backend})"


def pick_device(local_rank: int = 0, cuda_available: bool | None = None) -> DeviceChoice:
    """CUDA device ``local_rank`` with NCCL when CUDA is usable, else the CPU with gloo."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not available:
        return DeviceChoice(torch.device("cpu"), "gloo", local_rank)
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} needs GPU {local_rank}, but this pod sees {count} GPU(s)"
        )
    return DeviceChoice(torch.device("cuda", local_rank), "nccl", local_rank)


def activate(choice: DeviceChoice, environ: dict[str, str] | None = None) -> None:
    """Make ``choice`` current for this process: CUDA device and the NCCL environment."""
    env = os.environ if environ is None else environ
    if choice.backend == "nccl":
        for name, value in NCCL_RECOVERY_ENV.items():
            env.setdefault(name, value)
    if choice.is_cuda:
        torch.cuda.set_device(choice.device)


class AbortMonitor:
    """Aborts the current generation's communicators from a side thread when told to.

    ``should_abort`` is polled every ``interval_s``; when it turns true the monitor calls
    ``abort`` once (for NCCL: abort every process group of the generation), which makes
    a collective blocked in the main thread return with an error. Gloo cannot be
    interrupted this way (pytorch#130345; see failfast.py); on gloo the monitor is not started.

    ``wedged``: called once when the monitor is still not stopped ``wedged_after_s`` after
    the abort, i.e. the main thread never left the aborted generation (every wait of it is
    bounded by the collective timeout): the process is of no use to the job any more.
    """

    def __init__(
        self,
        should_abort: Callable[[], bool],
        abort: Callable[[], None],
        interval_s: float = 0.05,
        wedged: Callable[[], None] | None = None,
        wedged_after_s: float = 60.0,
    ) -> None:
        self._should_abort = should_abort
        self._abort = abort
        self._interval = interval_s
        self._wedged = wedged
        self._wedged_after_s = wedged_after_s
        self._stop = threading.Event()
        self.fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abort-monitor", daemon=True)

    def start(self) -> AbortMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if not self._should_abort():
                    continue
            except Exception as exc:  # a broken predicate must not kill the monitor silently
                log.warning("abort monitor: predicate failed: %s", exc)
                continue
            log.warning("aborting the generation's communicators")
            try:
                self._abort()
            finally:
                self.fired.set()
            if self._wedged is not None and not self._stop.wait(self._wedged_after_s):
                self._wedged()
            return


def abort_all_process_groups() -> None:
    """Abort every NCCL communicator of this process (torch's grouped abort)."""
    from torch.distributed import distributed_c10d as c10d

    aborter = getattr(c10d, "_abort_process_group", None)
    if aborter is not None:
        aborter()
        return
    for group in list(c10d._world.pg_map):  # older torch: one by one
        try:
            group.abort()
        except Exception as exc:
            log.debug("abort of %s failed: %s", group, exc)
