"""Checkpoint engine benchmark: blocking time and restore time against the usual ways.

For one model + Adam state (>= 1 GB full, ~50 MB with --quick), measured in one run:

- ``memcpy_s``: the raw copy of the same tensors into a preallocated buffer, one thread;
  ``memcpy_parallel_s``: the same with the tensors dealt out to one thread per core. The
  faster of the two (``best_memcpy_s``) is the physical limit of a snapshot;
- ``blocking_s``: our ``CheckpointEngine.snapshot`` (what training waits for);
- ``torch_save_fsync_s``: ``torch.save`` + fsync to local disk;
- ``dcp_async_blocking_s``: what ``torch.distributed.checkpoint.async_save`` blocks for;
- ``restore_shm_s``: our restore from shared memory (verified, into the live tensors);
  ``restore_fresh_s``: the same into fresh tensors (``into=None``, as the elastic runtime
  restores); ``memcpy_at_restore_s``: the raw copy again, right before them, which is what
  they are compared with. Before these three, the round's file writes (``torch.save``, DCP,
  the sidecar's persist) are synced to disk: their writeback would otherwise take a core
  from whichever of them runs first;
- ``verify_s``: one CRC-32C pass over the state with the engine's parallel checksum;
- ``torch_load_s``: ``torch.load`` of the saved file, page cache dropped (from disk);
  ``torch_load_warm_s`` is the same with the file cached, for reference.

Ratios against the copy (``restore_vs_memcpy = restore_shm_s / memcpy_at_restore_s``,
``blocking_vs_memcpy = blocking_s / memcpy_s``) and against DCP (``dcp_async_vs_blocking =
dcp_async_blocking_s / blocking_s``) are medians of per-round ratios: both sides of a
ratio ran in the same round, so a burst of load from other processes moves both. The
ratios of the medians are in the JSON too.

Ceilings: a snapshot that returns once the bytes are copied cannot block less than the best
copy, so ``save_vs_blocking_ceiling = torch_save_fsync_s / best_memcpy_s`` bounds the
save-vs-blocking ratio and ``dcp_async_blocking_s / best_memcpy_s`` the DCP one. The
restore checks the CRC-32C while it copies (one pass over memory), so its floor is the copy
plus the checksum's compute where the cores are busy, and the copy alone where a second
core is free; ``load_vs_restore_ceiling = torch_load_s / best_memcpy_s``. A target above
its ceiling is out of reach on the machine, whatever the engine does; the report says so.

Threads: torch's intra-op threads are set to 1 for everything (the baselines' save, load and
copy, and the engine's copies). Parallel copies use plain threads instead, each running
single-threaded ``copy_`` calls on its share (``memcpy_parallel_s``; the engine's
``copy_threads`` and checksum workers): on a shared machine, torch's OpenMP split of one copy
waits for its slowest thread and measured 2-5x slower than one thread, while threads taking
whole pieces keep the cores that are free busy. So one setting serves every contender.

Each figure is a median over ``--repeats`` rounds after two warm-up rounds; every round runs
each contender once, so load from other processes hits them alike (``load_average`` records
it). The sidecar (a real process) seals and persists every snapshot to disk before the
round goes on, as with a snapshot interval longer than a persist. Run: ``python
bench/checkpoint.py [--quick] [--out FILE]``; the JSON also holds every round's raw timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.operator.local.sidecars import CheckpointSidecars, default_sidecar_command
from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.checkpoint.checksum import checksum_parallel

# Upper bounds ("at most") and lower bounds ("at least"); see _target_line.
TARGETS = {
    "blocking_vs_memcpy": 1.2,
    "restore_vs_memcpy": 1.5,
    "dcp_async_vs_blocking": 5.0,
    "save_vs_blocking": 20.0,
    "load_vs_restore": 10.0,
}
AT_MOST = {"blocking_vs_memcpy", "restore_vs_memcpy"}
# Per-round ratios: (name, numerator, denominator).
PAIRED = (
    ("blocking_vs_memcpy", "blocking_s", "memcpy_s"),
    ("restore_vs_memcpy", "restore_shm_s", "memcpy_at_restore_s"),
    ("restore_fresh_vs_memcpy", "restore_fresh_s", "memcpy_at_restore_s"),
    ("dcp_async_vs_blocking", "dcp_async_blocking_s", "blocking_s"),
)


def make_state(total_bytes: int) -> dict[str, Any]:
    """Model + Adam (fp32): 12 bytes per parameter, in square-ish layers like a transformer."""
    params = total_bytes // 12
    width = 2048
    layers = max(1, params // (width * width))
    rows = params // (layers * width)
    model = {f"layers.{i}.weight": torch.full((rows, width), float(i)) for i in range(layers)}
    state = {
        i: {
            "step": torch.tensor(100.0),
            "exp_avg": torch.full((rows, width), 0.1),
            "exp_avg_sq": torch.full((rows, width), 0.01),
        }
        for i in range(layers)
    }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(state)}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 100}


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].values())
    for entry in state["optimizer"]["state"].values():
        out += list(entry.values())
    return out


def clock(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def deal(tensors: list[torch.Tensor], parts: int) -> list[list[tuple[int, torch.Tensor]]]:
    """(offset in a back-to-back buffer, tensor) dealt into ``parts`` shares of equal bytes
    (largest first, each to the lightest share)."""
    placed = []
    offset = 0
    for tensor in tensors:
        placed.append((offset, tensor))
        offset += tensor.numel() * tensor.element_size()
    shares: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for offset, tensor in sorted(placed, key=lambda item: -item[1].numel()):
        lightest = loads.index(min(loads))
        shares[lightest].append((offset, tensor))
        loads[lightest] += tensor.numel() * tensor.element_size()
    return [share for share in shares if share]


def drop_page_cache(path: Path) -> None:
    """Evict one file's pages from the page cache (no root needed): the next read hits disk."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Rounds:
    """Named timings collected round by round; every contender runs once per round, so a
    loaded machine slows them alike instead of skewing one phase."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items()}

    def paired(self, numerator: str, denominator: str) -> float:
        """The median over rounds of numerator / denominator measured in the same round."""
        pairs = zip(self.times[numerator], self.times[denominator], strict=True)
        return statistics.median(a / b for a, b in pairs)


def measure(size_bytes: int, repeats: int, workdir: Path) -> dict[str, Any]:
    state = make_state(size_bytes)
    tensors = tensors_of(state)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.zeros(state_bytes, dtype=torch.uint8)  # resident: the copy's physical limit

    def copy_share(share: list[tuple[int, torch.Tensor]]) -> None:
        for offset, t in share:
            n = t.numel() * t.element_size()
            flat[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)

    cores = os.cpu_count() or 1
    everything, shares = deal(tensors, 1)[0], deal(tensors, cores)
    copiers = ThreadPoolExecutor(cores, thread_name_prefix="bench-memcpy")

    def memcpy() -> None:
        copy_share(everything)

    def memcpy_parallel() -> None:
        list(copiers.map(copy_share, shares))

    def verify() -> None:
        view = memoryview(flat.numpy())
        try:
            checksum_parallel(view)  # the workers restore verifies with
        finally:
            view.release()

    path = workdir / "state.pt"

    def torch_save() -> None:
        with open(path, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())

    def torch_load_cold() -> float:
        drop_page_cache(path)
        started = time.perf_counter()
        loaded = torch.load(path)
        elapsed = time.perf_counter() - started
        del loaded
        return elapsed

    # The sidecar is started the way local mode starts it (one spawner in the product).
    sidecars = CheckpointSidecars(
        run_dir=workdir,
        shm_root=Path("/dev/shm") / f"bulkhead-bench-{os.getpid()}",
        token=secrets.token_hex(16),  # its replica port (unused here) never serves without one
        command=[*default_sidecar_command(), "--poll-interval", "0.05"],
    )
    shm_dir = sidecars.shm_dir(0)
    storage = workdir / "tce"
    sidecar_loop = asyncio.new_event_loop()  # the child process belongs to this loop
    sidecar_loop.run_until_complete(sidecars.start(WorkerRef(job="bench", slot=0, incarnation=0)))
    engine = CheckpointEngine(
        CheckpointSettings(job="bench", shm_dir=shm_dir, storage_dir=storage, keep=2)
    )
    rounds = Rounds()
    first: list[float] = []
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            "gloo", init_method=f"file://{workdir / 'pg'}", rank=0, world_size=1
        )
    load_before = os.getloadavg()
    try:
        for step in range(1, repeats + 3):
            warmup = step <= 2  # maps both slots, loads code paths: reported apart
            copy_s = clock(memcpy)
            copy_parallel_s = clock(memcpy_parallel)
            blocking_s = engine.snapshot(step, state).blocking_s
            persist_s = clock(lambda: _check(engine.flush(timeout=900)))
            save_s = clock(torch_save)
            target = workdir / f"dcp-{step}"
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(target))
            dcp_s = time.perf_counter() - started
            future.result()  # the background write is not what training waits for
            shutil.rmtree(target, ignore_errors=True)
            os.sync()  # no writeback of the files above competes with what follows
            copy_at_restore_s = clock(memcpy)
            restore_s = clock(lambda: _check_restored(engine.restore(into=state)))
            restore_fresh_s = clock(lambda: _check_restored(engine.restore()))
            verify_s = clock(verify)
            load_cold_s = torch_load_cold()
            load_warm_s = clock(lambda: torch.load(path))
            if warmup:
                first.append(blocking_s)
                continue
            rounds.add("memcpy_s", copy_s)
            rounds.add("memcpy_parallel_s", copy_parallel_s)
            rounds.add("blocking_s", blocking_s)
            rounds.add("sidecar_seal_and_persist_s", persist_s)
            rounds.add("torch_save_fsync_s", save_s)
            rounds.add("dcp_async_blocking_s", dcp_s)
            rounds.add("memcpy_at_restore_s", copy_at_restore_s)
            rounds.add("restore_shm_s", restore_s)
            rounds.add("restore_fresh_s", restore_fresh_s)
            rounds.add("verify_s", verify_s)
            rounds.add("torch_load_s", load_cold_s)
            rounds.add("torch_load_warm_s", load_warm_s)
    finally:
        if owns_group:
            dist.destroy_process_group()
        copiers.shutdown()
        engine.close()
        sidecar_loop.run_until_complete(sidecars.stop_all())
        sidecar_loop.close()
        shutil.rmtree(storage, ignore_errors=True)
        path.unlink(missing_ok=True)
    medians = rounds.medians()
    best_copy = min(medians["memcpy_s"], medians["memcpy_parallel_s"])
    return {
        "paired_ratios": {name: rounds.paired(a, b) for name, a, b in PAIRED},
        "state_bytes": state_bytes,
        "repeats": repeats,
        "copy_threads": engine.settings.copy_threads,
        "cpu_count": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        **medians,
        "best_memcpy_s": best_copy,
        "save_vs_blocking_ceiling": medians["torch_save_fsync_s"] / best_copy,
        "dcp_async_vs_blocking_ceiling": medians["dcp_async_blocking_s"] / best_copy,
        "load_vs_restore_ceiling": medians["torch_load_s"] / best_copy,
        "first_snapshots_s": first,
        "rounds": rounds.times,
    }


def _check(status: dict[str, Any]) -> None:
    if not status.get("ok") or status.get("last_error"):
        raise RuntimeError(f"sidecar failed: {status}")


def _check_restored(restored: Any) -> None:
    if restored is None or restored.tier != "shm" or restored.skipped:
        raise RuntimeError(f"expected a clean restore from shared memory, got {restored}")


def report(results: dict[str, Any]) -> dict[str, float]:
    best_copy = results["best_memcpy_s"]
    ratios = {
        **results["paired_ratios"],
        "save_vs_blocking": results["torch_save_fsync_s"] / results["blocking_s"],
        "load_vs_restore": results["torch_load_s"] / results["restore_shm_s"],
        "warm_load_vs_restore": results["torch_load_warm_s"] / results["restore_shm_s"],
    }
    of_medians = {
        "blocking_vs_memcpy": results["blocking_s"] / results["memcpy_s"],
        "restore_vs_memcpy": results["restore_shm_s"] / results["memcpy_at_restore_s"],
        "dcp_async_vs_blocking": results["dcp_async_blocking_s"] / results["blocking_s"],
    }
    gb = results["state_bytes"] / 1e9
    load = results["load_average"]["before"][0]
    print(
        f"state: {gb:.2f} GB (model + Adam, fp32), medians of {results['repeats']}; "
        f"{results['cpu_count']} cores, load average {load:.1f}, "
        f"engine copy threads {results['copy_threads']}"
    )
    rows = [
        ("raw memcpy, 1 thread", results["memcpy_s"], "all cores", results["memcpy_parallel_s"]),
        ("snapshot blocking (ours)", results["blocking_s"], "memcpy", results["memcpy_s"]),
        ("torch.save + fsync", results["torch_save_fsync_s"], "ours", results["blocking_s"]),
        (
            "DCP async_save (blocking)",
            results["dcp_async_blocking_s"],
            "ours",
            results["blocking_s"],
        ),
        ("raw memcpy, before restore", results["memcpy_at_restore_s"], "", 0.0),
        ("restore shm (ours)", results["restore_shm_s"], "memcpy", results["memcpy_at_restore_s"]),
        (
            "  into fresh tensors",
            results["restore_fresh_s"],
            "memcpy",
            results["memcpy_at_restore_s"],
        ),
        ("  verify, then copy", _restore_floor(results), "memcpy", results["memcpy_at_restore_s"]),
        ("torch.load (disk)", results["torch_load_s"], "restore shm", results["restore_shm_s"]),
        (
            "torch.load (cached)",
            results["torch_load_warm_s"],
            "restore shm",
            results["restore_shm_s"],
        ),
    ]
    print(f"{'measure':28} {'seconds':>9}   {'vs':12} {'seconds':>9} {'ratio':>8}")
    for name, value, other, other_value in rows:
        if not other:
            print(f"{name:28} {value:9.4f}")
            continue
        ratio = value / other_value
        print(f"{name:28} {value:9.4f}   {other:12} {other_value:9.4f} {ratio:8.2f}x")
    print(f"one verify pass (parallel CRC-32C): {results['verify_s']:.4f}s")
    print(f"sidecar seal + persist to disk (async): {results['sidecar_seal_and_persist_s']:.3f}s")
    print(
        "medians of per-round ratios below; ratios of the medians: "
        + ", ".join(f"{key} {value:.2f}" for key, value in of_medians.items())
    )
    ceilings = {
        # The best a snapshot can do is the copy itself; a restore, a copy that verifies.
        "blocking_vs_memcpy": best_copy / results["memcpy_s"],
        "restore_vs_memcpy": best_copy / results["memcpy_at_restore_s"],
        "dcp_async_vs_blocking": results["dcp_async_vs_blocking_ceiling"],
        "save_vs_blocking": results["save_vs_blocking_ceiling"],
        "load_vs_restore": results["load_vs_restore_ceiling"],
    }
    for key, target in TARGETS.items():
        print(_target_line(key, ratios[key], target, ceilings[key]))
    return ratios


def _restore_floor(results: dict[str, Any]) -> float:
    """What a restore that verified every byte before copying any would need at least: one
    CRC pass plus one copy (the engine verifies while copying instead)."""
    return results["verify_s"] + results["best_memcpy_s"]


def _target_line(key: str, ratio: float, target: float, ceiling: float) -> str:
    """One target: ratio, target, what this machine allows at best, and the verdict."""
    at_most = key in AT_MOST
    met = ratio <= target if at_most else ratio >= target
    reachable = ceiling <= target if at_most else ceiling >= target
    notes = f"{'<=' if at_most else '>='} {target:g}; best possible here {ceiling:.2f}"
    if (ratio < ceiling) if at_most else (ratio > ceiling):
        # Medians of separate noisy measurements can cross: trust neither to the last digit.
        notes += ", beaten: the timings are noisy, see the load average"
    line = f"target {key}: {ratio:.2f} ({notes}) "
    if met:
        return line + "met"
    if not reachable:
        return line + f"NOT met: out of reach on this machine (ceiling {ceiling:.2f})"
    return line + "NOT met"


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~50 MB state, 5 repeats")
    parser.add_argument("--size-gb", type=float, default=None, help="state size (default 1.1)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="disk directory for files")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    size = args.size_gb or (0.05 if args.quick else 1.1)
    repeats = args.repeats or (5 if args.quick else 7)
    base = args.dir or Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-", dir=base) as workdir:
        results = measure(int(size * 1e9), repeats, Path(workdir))
    results["ratios"] = report(results)
    results["quick"] = args.quick
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
