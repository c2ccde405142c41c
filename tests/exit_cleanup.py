"""What the test process undoes before it exits, so that its output ends with the summary.

A control server started in this process freezes every object alive at that moment out
of the cyclic garbage collector (``tune_gc_for_connections`` in operator/control.py: the
operator's endpoint holds thousands of long polls). The operator's own processes never
import torch, but the test process does, and torch's first optimizer step or DDP wrap
imports ``torch._dynamo`` and with it triton. Frozen, triton's objects are never freed,
not even at interpreter exit, and triton's bindings (nanobind) then report each of them
as leaked: hundreds of lines after the test summary.
"""

from __future__ import annotations

import gc


def release_frozen_objects() -> None:
    """Return frozen objects to the collector, so interpreter exit frees them as usual."""
    gc.unfreeze()
