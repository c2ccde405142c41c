"""A worker imports before it registers what building an engine would import on first use.

A replacement that imported ``torch._dynamo`` inside its first DDP or FSDP2 wrap held the
survivors in that generation's rendezvous for 1-1.4 s. Each case runs in a fresh
interpreter, since this one has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from bulkhead.trainer.engine.data_parallel import wrap_data_parallel
from bulkhead.trainer.engine.engine import import_lazy_dependencies

if sys.argv[1] == "warm":
    import_lazy_dependencies()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = set(sys.modules)
wrap_data_parallel(torch.nn.Linear(4, 4), torch.device("cpu"))
fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))
heavy = ("torch._dynamo", "torch._inductor")
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith(heavy))))
"""


def _imported_by_wraps(mode: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_engine_wraps_import_nothing_heavy_after_the_warm_up(mode: str) -> None:
    imported = _imported_by_wraps(mode)
    if mode == "cold":
        # Why the warm-up exists: without it the first wrap imports the compiler stack.
        assert "torch._dynamo" in imported
    else:
        assert imported == []
