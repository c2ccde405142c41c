"""Adam's state on a ZeRO-3 first build: the zero-gradient step vs creating it directly.

Each engine built on a new mesh size creates its optimizer state before adopting any
(``materialize_optimizer`` in trainer/engine/optim.py), on the recovery's path. It used
to take one AdamW step at learning rate 0 over the DTensor shards (``materialize_by_step``,
still the way for other optimizers); Adam(W)'s state is now created directly
(``materialize_directly``). Here N gloo ranks, fresh processes forked from one fork server
(as ``bench/_engine_runs.py`` does), form a world and build the ZeRO-3 engine of
examples/local-zero.yaml's model (tiny preset, hpZ blocks of 2 from 4 ranks) as a worker
does (``open_world`` -> ``build_engine``), once with each way; the ways alternate round by
round (which goes first too). As in a worker, the heap of the imports is frozen out of
the cyclic GC first (``gc.freeze``), so that a full GC pass does not land in one of the
timings by chance. Each build is timed in CPU seconds of the rank's process
(``time.process_time``: the machine is shared, wall time is not comparable), the whole
build and the materialization inside it, and in wall seconds. Prints the medians and the
ratio; ``--out FILE`` writes ``{ranks, rounds, <way>_materialize_cpu_s, <way>_build_cpu_s,
ratio, load, ...}``; ``--quick``: 2 ranks, 1 round.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_runs import _open, engine_config, process_context

from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.engine import parallelize
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.optim import materialize_by_step, materialize_directly

WAYS = ("by_step", "direct")


def _rank(slot: int, ranks: int, way: str, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    gc.freeze()  # as a worker does once its imports are done (ElasticTrainer.run)
    timed: dict[str, float] = {}

    def materialize(_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        if way == "by_step" or not materialize_directly(optimizer):
            materialize_by_step(optimizer)
        timed["materialize_cpu_s"] = time.process_time() - cpu
        timed["materialize_wall_s"] = time.perf_counter() - wall

    # build_engine calls this module's name: the way under test, the real functions.
    parallelize.materialize_optimizer = materialize
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    # As local-zero.yaml: two replica groups with hpZ blocks of 2 (from 4 ranks on).
    big = ranks >= 4
    cfg = engine_config(3, 2 if big else 1, ranks, 1 if big else 0, model={"preset": "tiny"})
    cpu, wall = time.process_time(), time.perf_counter()
    world, _engine = _open(1, slot, list(range(ranks)), store, pick_device(False), cfg)
    timed["build_cpu_s"] = time.process_time() - cpu
    timed["build_wall_s"] = time.perf_counter() - wall
    Path(out_dir, f"rank{slot}.json").write_text(json.dumps(timed))
    world.close()


def _build(ranks: int, way: str) -> list[dict[str, float]]:
    """One build on ``ranks`` fresh processes: each rank's timings."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    ctx = process_context()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_rank, args=(s, ranks, way, store.port, out_dir))
            for s in range(ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        if codes != [0] * ranks:
            raise SystemExit(f"{way}: ranks failed: exit codes {codes}")
        return [json.loads(Path(out_dir, f"rank{s}.json").read_text()) for s in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the figures as JSON here.")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 round.")
    parser.add_argument("--ranks", type=int, default=8, help="Ranks (workers) of the mesh.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternated builds per way.")
    args = parser.parse_args()
    end_children_on_exit()  # a timeout or Ctrl-C leaves no rank behind
    ranks, rounds = (2, 1) if args.quick else (args.ranks, args.rounds)
    timings: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else tuple(reversed(WAYS)):
            timings[way] += _build(ranks, way)
    result: dict[str, Any] = {"ranks": ranks, "rounds": rounds}
    for way in WAYS:
        for key in ("materialize_cpu_s", "materialize_wall_s", "build_cpu_s", "build_wall_s"):
            values = [t[key] for t in timings[way]]
            result[f"{way}_{key}"] = statistics.median(values)
            result[f"{way}_{key}_all"] = values
    result["ratio"] = result["by_step_materialize_cpu_s"] / result["direct_materialize_cpu_s"]
    with open("/proc/loadavg") as f:
        result["load"] = f.read().split()[:3]
    print(
        f"{ranks} ranks, {rounds} round(s), medians per rank (CPU s): materialize by step "
        f"{result['by_step_materialize_cpu_s']:.3f} s, directly "
        f"{result['direct_materialize_cpu_s']:.4f} s ({result['ratio']:.0f}x); whole build "
        f"{result['by_step_build_cpu_s']:.2f} s vs {result['direct_build_cpu_s']:.2f} s; "
        f"load {' '.join(result['load'])}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
