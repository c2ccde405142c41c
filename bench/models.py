"""Hugging Face weights in and out, side by side with safetensors alone (issue 34 targets).

1. Import into N ranks: N processes each read their ZeRO share (torch.chunk rows of every
   parameter, as the engine shards) of a sharded checkpoint with ``read_params``. Measured:
   the bytes all ranks read together vs the checkpoint's tensor bytes (target <= 1.1x), and
   the wall time from the common start to the last rank's end vs one process reading every
   file once, whole, into memory (target <= 1.5x). Both sides read into memory allocated
   and touched before the clock starts: the engine fills state that exists (``into``), and
   on this VM the first touch of fresh pages costs about as much as the read itself, which
   the baseline, re-reading in one long-lived process, would otherwise escape through the
   allocator's recycled heap while four fresh ranks could not.
2. Export: ``export_hf`` (shards, index, config.json) vs safetensors' ``save_file`` of the
   same tensors into one file from one process (target <= 1.5x).
3. Steady state, llama vs gpt (the protocol costs nothing; target within 3 %): CPU per
   training FLOP and the engine overhead ratio (engine step over the bare model's own
   step), medians over many alternated rounds: ``_steady_families``.

Every timing of parts 1 and 2 is the best of a few rounds in which both sides run back to
back (the machine is shared: the best is the least disturbed); CPU seconds are reported
beside wall seconds. Both sides read files the previous step just wrote, i.e. from the
page cache.

    .venv/bin/python -P bench/models.py [--quick] [--out FILE] [--ranks N] [--only io|steady]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.models.hf import ReadStats, read_params
from bulkhead.trainer.models.hf_export import export_hf
from bulkhead.trainer.models.llama import Llama
from bulkhead.trainer.models.sizes import LlamaSizes
from bulkhead.trainer.parallel.layout import KeySpec, shard_range


def sizes_for(quick: bool) -> LlamaSizes:
    if quick:
        return LlamaSizes(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=704, seq_len=128)  # fmt: skip
    return LlamaSizes(vocab_size=16000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                      ffn_dim=1408, seq_len=1024)  # fmt: skip


def _share(model: Llama, rank: int, ranks: int) -> dict[str, tuple[int, int]]:
    """Rank ``rank``'s ZeRO rows of every parameter, as the engine's layout cuts them."""
    wanted = {}
    for name, p in model.named_parameters():
        spec = KeySpec(name, p.numel(), p.shape[0], "float32", shardable=True)
        start, stop = shard_range(spec, ranks, rank)
        if stop > start:
            wanted[name] = (start, stop)
    return wanted


def _destinations(wanted: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The rank's state for its share, allocated and touched before the clock starts (an
    engine's state exists before the import fills it)."""
    return {name: torch.empty(stop - start).zero_() for name, (start, stop) in wanted.items()}


def _rank(directory: str, rank: int, ranks: int, start_at: float, sizes: LlamaSizes) -> tuple:
    with torch.device("meta"):
        model = Llama(sizes)
    wanted = _share(model, rank, ranks)
    into = _destinations(wanted)
    _wait_until(start_at)
    cpu = time.process_time()
    stats = ReadStats()
    read_params(directory, model, wanted, stats=stats, into=into)
    return stats.bytes, start_at, time.monotonic(), time.process_time() - cpu


def _wait_until(moment: float) -> None:
    """Sleep, then spin the last millisecond, until ``time.monotonic()`` reaches ``moment``
    (one clock for every process of the machine): the ranks start together, which a
    barrier served by another process does not give (its waiters woke up to 25 ms apart)."""
    while (left := moment - time.monotonic()) > 0.001:
        time.sleep(left - 0.001)
    while time.monotonic() < moment:
        pass


# Time the ranks get to be handed their task and set up before the common start.
_START_MARGIN_S = 0.5


class RankProcesses:
    """One process per importing rank, started (and torch imported) once, each reading its
    share when told the instant to start. Not a ``multiprocessing.Pool``: a pool's worker
    handler starts a new worker for one that exits, so a SIGTERM that ends the bench's
    children could race it and leave one behind."""

    def __init__(self, ctx: Any, directory: Path, ranks: int, sizes: LlamaSizes) -> None:
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(ranks)]
        self.procs = [
            ctx.Process(target=_serve_rank, daemon=True,
                        args=(str(directory), r, ranks, sizes, self.tasks[r], self.results))
            for r in range(ranks)
        ]  # fmt: skip
        for p in self.procs:
            p.start()
        for _ in self.procs:  # every rank imported torch and waits
            self.results.get(timeout=_RANK_TIMEOUT_S)

    def round(self) -> dict:
        start_at = time.monotonic() + _START_MARGIN_S
        for tasks in self.tasks:
            tasks.put(start_at)
        results = [self.results.get(timeout=_RANK_TIMEOUT_S) for _ in self.tasks]
        return {
            "bytes": sum(r[0] for r in results),
            "max_rank_bytes": max(r[0] for r in results),
            "wall_s": max(r[2] for r in results) - start_at,
            "cpu_s": sum(r[3] for r in results),
        }

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for p in self.procs:
            p.join(timeout=_RANK_TIMEOUT_S)


_RANK_TIMEOUT_S = 300.0


def _serve_rank(directory: str, rank: int, ranks: int, sizes: LlamaSizes, tasks: Any,
                results: Any) -> None:  # fmt: skip
    results.put(None)  # ready
    while (start_at := tasks.get()) is not None:
        results.put(_rank(directory, rank, ranks, start_at, sizes))


def baseline_read(directory: Path) -> dict[str, float]:
    """One process reading every file once, whole, into memory: the floor for getting the
    checkpoint's bytes off the files (no parsing, one read per file)."""
    paths = sorted(directory.glob("*.safetensors"))
    buffers = [torch.empty(p.stat().st_size, dtype=torch.uint8).zero_() for p in paths]
    started, cpu = time.perf_counter(), time.process_time()
    total = 0
    for path, buffer in zip(paths, buffers, strict=True):
        with open(path, "rb", buffering=0) as f:
            total += f.readinto(memoryview(buffer.numpy()))
    return {"bytes": total, "wall_s": time.perf_counter() - started,
            "cpu_s": time.process_time() - cpu}  # fmt: skip


def sequential_shares(directory: Path, ranks: int, sizes: LlamaSizes) -> dict[str, float]:
    """Every rank's share read one after the other in this process: the reading cost per
    byte without the ranks contending for the two cores."""
    with torch.device("meta"):
        model = Llama(sizes)
    shares = [_share(model, r, ranks) for r in range(ranks)]
    destinations = [_destinations(wanted) for wanted in shares]
    started, cpu = time.perf_counter(), time.process_time()
    for wanted, into in zip(shares, destinations, strict=True):
        read_params(directory, model, wanted, into=into)
    return {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, float]:
    started, cpu = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--ranks", type=int, default=4, help="importing processes")
    parser.add_argument("--only", choices=("io", "steady"), help="run one part")
    args = parser.parse_args()
    figures: dict[str, Any] = {"quick": args.quick}
    if args.only != "steady":
        figures |= io_figures(args)
    if args.only != "io":
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_engine_runs.py
        from _steady_families import report, steady_state

        work = Path(tempfile.mkdtemp(prefix="bench-models-steady-"))
        try:

            def save(partial: dict[str, Any]) -> None:  # each round's figures so far
                if args.out:
                    Path(args.out).write_text(json.dumps(figures | {"steady_state": partial}))

            figures["steady_state"] = steady_state(args.quick, work, save)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        report(figures["steady_state"])
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")


def io_figures(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 and 2 of the module docstring."""
    sizes = sizes_for(args.quick)
    rounds = 2 if args.quick else 5
    torch.manual_seed(0)
    state = {n: p.detach() for n, p in Llama(sizes).named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shard_bytes = max(nbytes // 6, 1 << 20)
    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    try:
        ours_export, base_export, ours_import, base_import, sequential = [], [], [], [], []
        for i in range(rounds):
            out, single = work / f"hf-{i}", work / f"single-{i}.safetensors"
            ours_export.append(timed(export_hf, state, sizes, out, shard_bytes, progress=False))
            base_export.append(timed(save_file, state, str(single), metadata={"format": "pt"}))
            single.unlink()
        directory = work / "hf-0"
        # spawn: a forked child of a process that ran torch's OpenMP pool can deadlock in
        # it. The ranks start (and import torch) once; each round starts them together.
        ctx = multiprocessing.get_context("spawn")
        ranks = RankProcesses(ctx, directory, args.ranks, sizes)
        try:
            for _ in range(rounds):
                ours_import.append(ranks.round())
                base_import.append(baseline_read(directory))
                sequential.append(sequential_shares(directory, args.ranks, sizes))
        finally:
            ranks.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best_ours = min(ours_import, key=lambda r: r["wall_s"])
    best_base = min(base_import, key=lambda r: r["wall_s"])
    best_sequential = min(sequential, key=lambda r: r["cpu_s"])
    base_cpu = min(r["cpu_s"] for r in base_import)
    export_s, export_cpu = min(ours_export)
    save_s, save_cpu = min(base_export)
    figures = {
        "params": sum(t.numel() for t in state.values()),
        "checkpoint_bytes": nbytes,
        "ranks": args.ranks,
        "import_bytes_read": best_ours["bytes"],
        "import_bytes_ratio": best_ours["bytes"] / nbytes,
        "import_max_rank_share": best_ours["max_rank_bytes"] / (nbytes / args.ranks),
        "import_wall_s": best_ours["wall_s"],
        "import_cpu_s": best_ours["cpu_s"],
        "baseline_read_wall_s": best_base["wall_s"],
        "baseline_read_cpu_s": best_base["cpu_s"],
        "import_wall_ratio": best_ours["wall_s"] / best_base["wall_s"],
        "import_sequential_cpu_s": best_sequential["cpu_s"],
        "import_sequential_cpu_ratio": best_sequential["cpu_s"] / base_cpu,
        "export_s": export_s,
        "export_cpu_s": export_cpu,
        "save_file_s": save_s,
        "save_file_cpu_s": save_cpu,
        "export_ratio": export_s / save_s,
    }
    print(
        f"import of {nbytes / 1e6:.1f} MB into {args.ranks} ranks: read "
        f"{figures['import_bytes_ratio']:.3f}x the checkpoint (target <= 1.1x), largest rank "
        f"{figures['import_max_rank_share']:.2f}x its share; wall {best_ours['wall_s']:.3f} s "
        f"vs {best_base['wall_s']:.3f} s for one process reading every file = "
        f"{figures['import_wall_ratio']:.2f}x (target <= 1.5x); CPU {best_ours['cpu_s']:.3f} s "
        f"vs {best_base['cpu_s']:.3f} s; the {args.ranks} shares read one after the other in "
        f"one process: {best_sequential['cpu_s']:.3f} s CPU = "
        f"{figures['import_sequential_cpu_ratio']:.2f}x the one whole read"
    )
    print(
        f"export: {export_s:.3f} s ({export_cpu:.3f} s CPU) vs safetensors save_file "
        f"{save_s:.3f} s ({save_cpu:.3f} s CPU) = {figures['export_ratio']:.2f}x (target <= 1.5x)"
    )
    return figures


if __name__ == "__main__":
    main()
