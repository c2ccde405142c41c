"""A stand-in trainer process for crash tests: snapshots forever, one line per snapshot.

Usage: python ckpt_trainer_child.py SHM_DIR JOB SCALE [STORAGE]
Each snapshot's tensors all hold its step, so any restore can be checked for tearing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from ckpt_helpers import make_state

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings


def main() -> None:
    torch.set_num_threads(1)
    shm_dir, job, scale = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    storage = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    engine = CheckpointEngine(CheckpointSettings(job=job, shm_dir=shm_dir, storage_dir=storage))
    state = make_state(0, scale)
    step = 0
    while True:
        step += 1
        for tensor in (state["model"]["embed.weight"], state["optimizer"]["state"][0]["exp_avg"]):
            tensor.fill_(float(step))
        fresh = make_state(step, scale)
        fresh["model"]["embed.weight"] = state["model"]["embed.weight"]
        fresh["optimizer"]["state"][0]["exp_avg"] = state["optimizer"]["state"][0]["exp_avg"]
        engine.snapshot(step, fresh)
        print(step, flush=True)


if __name__ == "__main__":
    main()
