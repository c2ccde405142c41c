"""Child of test_shm_full: snapshots into a shared-memory directory that is a tiny tmpfs.

Runs inside a private mount namespace the test created, so the tmpfs is seen by nobody
else. Prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ckpt_helpers import assert_state_is, make_state

from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.checkpoint.sidecar import Sidecar
from bulkhead.trainer.checkpoint.trainer_side import CheckpointError


def main() -> None:
    shm_dir = Path(sys.argv[1])
    sidecar = Sidecar(shm_dir, shm_dir / "checkpointd.sock", poll_interval=0.1)
    sidecar.start()
    out: dict[str, object] = {}
    settings = CheckpointSettings(job="job1", shm_dir=shm_dir, seal_timeout_s=30)
    try:
        with CheckpointEngine(settings) as engine:
            engine.snapshot(10, make_state(10))  # small: fits
            engine.flush(timeout=30)
            try:
                engine.snapshot(20, make_state(20, scale=200))  # about 3.3 MB: does not fit
                out["second"] = "fitted"
            except CheckpointError as exc:  # what the runtime catches: training goes on
                out["second"] = "refused"
                out["message"] = str(exc)
            restored = engine.restore()
            assert restored is not None
            out["restored_step"] = restored.step
            assert_state_is(restored.state, restored.step)
            out["restored_intact"] = True
    finally:
        sidecar.stop(drain_timeout=10)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
