"""Worker processes for the multi-process tests, forked from a server that imported torch
and the trainer once.

A spawned process imports them again (about 4 s of CPU each on this machine): with five
workers per scenario that was most of every engine test's time. The fork server is
started once per test process and serves every test; it runs no torch operation and
holds no thread or process group, so a process forked from it starts as clean as a
spawned one.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

# By package name: Python 3.11's fork server preloads before it takes the parent's
# sys.path, so a test module cannot be named here (it would be skipped silently); test
# modules are imported by each child, cheaply once these are loaded.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch._dynamo",  # what a first DDP or FSDP2 wrap imports (import_lazy_dependencies)
    "bulkhead.trainer.config",
    "bulkhead.trainer.data",
    "bulkhead.trainer.engine.parallelize",  # the engine and every layout
    "bulkhead.trainer.models.gpt",
    "bulkhead.trainer.parallel.plan",
    "bulkhead.trainer.engine.world",
    "bulkhead.trainer.runtime.loop",
]


def preloaded_context() -> BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
