"""The options of a ``bench/gpu_check.py`` run: the device, the model sizes, the counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bulkhead.trainer.engine.device import DeviceChoice, pick_device

# The equivalence runs (checks 1, 2 and 4): d 128, 4 layers, 128 tokens on a GPU machine;
# with --cpu (a shared 2-core test machine) d 64, 2 layers, 64 tokens.
SMALL = {"preset": "small"}
TINY = {"preset": "tiny"}
# The throughput and snapshot runs on a GPU: ~100 M parameters, 16 x 1024 tokens a step.
BENCH = {"dModel": 1024, "nLayers": 8, "nHeads": 16, "seqLen": 1024, "ffnDim": 4096}
BENCH_BATCH = (16, 8)  # global, micro


@dataclass(frozen=True)
class Options:
    cpu: bool
    quick: bool

    @property
    def steps(self) -> int:
        """Steps of the equivalence runs."""
        return 8 if self.quick else 20

    @property
    def timed_steps(self) -> int:
        return 3 if self.quick or self.cpu else 10

    @property
    def repeats(self) -> int:
        """Repeats of each timed copy (the median is reported)."""
        return 2 if self.quick or self.cpu else 5

    @property
    def small(self) -> dict[str, Any]:
        """The model of the equivalence runs."""
        return TINY if self.cpu else SMALL

    @property
    def big(self) -> dict[str, Any]:
        """The model of the throughput and snapshot runs."""
        return SMALL if self.cpu else BENCH

    @property
    def big_batch(self) -> tuple[int, int]:
        return (8, 1) if self.cpu else BENCH_BATCH

    def device(self) -> DeviceChoice:
        return pick_device(0, cuda_available=False if self.cpu else None)
