"""Data benchmark: ``bulkhead data prepare`` throughput, and a worker's memory on a large
token corpus.

Throughput: a byte-level BPE (vocabulary 4096, trained here on the standard library's
``json`` package) tokenizes the standard library's ``*.py`` files (``--quick``: the first
1.5 MB of them) twice per round with the same number of processes: ``prepare`` (reading,
batch encoding, ids to numpy, shards, sha256, index) and the baseline, a pool of the same
size calling the tokenizer's ``encode_batch`` directly on the same files, grouped alike,
and counting the ids. Rounds alternate which side runs first; the figure is the median of
the per-round ratios of baseline wall time to prepare wall time (target >= 0.8), with the
CPU-time ratio beside it (this machine is shared, so wall time is noisy; CPU time counts
every process of each side).

Memory: random token shards (uint16, written by the same shard writer as ``prepare``) of
2 GB and 20 MB (``--quick``: 200 MB and 2 MB); a fresh process per corpus opens it (the
first open hashes every shard, the second finds the stamps) and reads as many batches as a
worker of a long run would (seqLen 1024, 8 sequences), then reports its RSS. Target: the
two RSS within 50 MB.

Run: ``python bench/data.py [--quick] [--workers N] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.data.index import (
    INDEX_FILE,
    ShardEntry,
    ShardWriter,
    TokenIndex,
    atomic_write,
    shard_name,
)
from bulkhead.trainer.data.prepare import UNIT_BYTES, input_files, plan_units, prepare
from bulkhead.trainer.data.tokenizer import load_tokenizer, train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 4096
BATCH = 8
RSS_TARGET_MB = 50.0


# -- throughput --------------------------------------------------------------------------

_tok: dict[str, Any] = {}


def _init_baseline(path: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as prepare's workers: one core each
    _tok["t"] = load_tokenizer(path)


def _baseline_task(paths: list[str]) -> int:
    docs = [Path(p).read_bytes().decode("utf-8", errors="replace") for p in paths]
    return sum(len(e.ids) for e in _tok["t"].encode_batch(docs, add_special_tokens=False))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_baseline(tokenizer: Path, pattern: str, workers: int) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (all processes) and tokens of the direct encoder."""
    units = plan_units(input_files(pattern))  # the same file groups as prepare's units
    tasks = [[p.path for p in u.pieces] for u in units]
    cpu0, child0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(tasks)), _init_baseline, (str(tokenizer),)) as pool:
        tokens = sum(pool.imap(_baseline_task, tasks, chunksize=1))
    wall = time.perf_counter() - t0
    return wall, time.process_time() - cpu0 + _children_cpu() - child0, tokens


def run_prepare(tokenizer: Path, pattern: str, workers: int, out: Path) -> tuple[float, float, int]:
    cpu0, child0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    index = prepare(tokenizer, pattern, out, workers=workers)
    wall = time.perf_counter() - t0
    # Documents' end tokens are prepare's own: the baseline does not count them.
    return (
        wall,
        time.process_time() - cpu0 + _children_cpu() - child0,
        index.tokens - index.documents,
    )


def throughput(tmp: Path, quick: bool, workers: int, rounds: int) -> dict[str, Any]:
    tokenizer = tmp / "tok"
    train_bpe(sorted((STDLIB / "json").glob("*.py")), VOCAB, tokenizer)
    # Imported here: the pools' spawned processes re-import this module, and text imports
    # torch, which neither side's workers need.
    from bulkhead.trainer.data.text import stdlib_files

    # The standard library without installed packages, linked into one tree.
    corpus, nbytes = tmp / "corpus", 0
    for path in stdlib_files():
        if quick and nbytes > 1.5e6:
            break
        link = corpus / path.relative_to(STDLIB)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
        nbytes += path.stat().st_size
    pattern = str(corpus / "**" / "*.py")
    files = input_files(pattern)
    nbytes = sum(f.stat().st_size for f in files)
    rows = []
    for r in range(rounds):
        out = tmp / f"shards-{r}"
        sides = ["baseline", "prepare"] if r % 2 == 0 else ["prepare", "baseline"]
        row: dict[str, Any] = {}
        for side in sides:
            if side == "baseline":
                row["baseline"] = run_baseline(tokenizer, pattern, workers)
            else:
                row["prepare"] = run_prepare(tokenizer, pattern, workers, out)
        assert row["baseline"][2] == row["prepare"][2], "both sides must encode the same ids"
        rows.append(row)
        print(
            f"round {r}: prepare {row['prepare'][0]:.2f} s wall / {row['prepare'][1]:.2f} s CPU, "
            f"encode_batch {row['baseline'][0]:.2f} s / {row['baseline'][1]:.2f} s"
        )
    wall = statistics.median(r["baseline"][0] / r["prepare"][0] for r in rows)
    cpu = statistics.median(r["baseline"][1] / r["prepare"][1] for r in rows)
    prepare_mb_s = statistics.median(nbytes / r["prepare"][0] / 1e6 for r in rows)
    return {
        "input_files": len(files),
        "input_mb": nbytes / 1e6,
        "tokens": rows[0]["prepare"][2],
        "workers": workers,
        "unit_bytes": UNIT_BYTES,
        "prepare_mb_per_s": prepare_mb_s,
        "prepare_vs_encoder": wall,
        "prepare_vs_encoder_cpu": cpu,
        "rounds": [{k: list(v) for k, v in r.items()} for r in rows],
    }


# -- memory -------------------------------------------------------------------------------


def write_random_corpus(out: Path, tokens: int, shard_tokens: int, seed: int) -> None:
    """Random uint16 tokens as shards + index, by the same writer as ``prepare``."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    entries, left, number = [], tokens, 0
    while left:
        writer = ShardWriter(out / shard_name(number), "uint16")
        size = min(shard_tokens, left)
        for start in range(0, size, 1 << 24):
            writer.write(rng.integers(0, VOCAB, min(1 << 24, size - start), dtype=np.uint16))
        entries.append(ShardEntry(writer.path.name, size, 0, writer.commit()))
        left -= size
        number += 1
    index = TokenIndex("uint16", VOCAB, VOCAB - 1, 0, "sha256:synthetic", 0, tokens, tuple(entries))
    atomic_write(out / INDEX_FILE, index.to_json().encode())


READER = """
import json, sys, time
from pathlib import Path
import psutil
from bulkhead.trainer.data.shards import open_tokens
from bulkhead.trainer.data.order import step_positions
directory, cache, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
me = psutil.Process()
t0 = time.perf_counter(); open_tokens(directory, 1024, 0, 4096, cache_dir=cache)
cold = time.perf_counter() - t0
t0 = time.perf_counter(); dataset = open_tokens(directory, 1024, 0, 4096, cache_dir=cache)
warm = time.perf_counter() - t0
before = me.memory_info().rss
t0 = time.perf_counter()
for step in range(steps):
    dataset.batch(list(step_positions(step, 8)))
read_s = time.perf_counter() - t0
print(json.dumps({"open_cold_s": cold, "open_warm_s": warm, "rss_before_mb": before / 1e6,
                  "rss_mb": me.memory_info().rss / 1e6, "batch_ms": read_s / steps * 1e3}))
"""


def memory(tmp: Path, quick: bool) -> dict[str, Any]:
    large, small = (100_000_000, 1_000_000) if quick else (1_000_000_000, 10_000_000)
    steps = 200 if quick else 2000
    out: dict[str, Any] = {}
    for name, tokens in (("large", large), ("small", small)):
        directory = tmp / f"random-{name}"
        t0 = time.perf_counter()
        write_random_corpus(directory, tokens, 1 << 27, seed=len(name))
        print(f"{name}: wrote {tokens * 2 / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s")
        cache = tmp / f"cache-{name}"
        proc = subprocess.run(
            [sys.executable, "-P", "-c", READER, str(directory), str(cache), str(steps)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        figures = json.loads(proc.stdout)
        out[name] = {"corpus_mb": tokens * 2 / 1e6, **figures}
        print(
            f"{name}: {tokens * 2 / 1e6:.0f} MB corpus, open {figures['open_cold_s']:.2f} s "
            f"(hashing) / {figures['open_warm_s'] * 1e3:.1f} ms (stamped), RSS "
            f"{figures['rss_mb']:.1f} MB after {steps} batches "
            f"({figures['batch_ms']:.2f} ms each)"
        )
    return {
        "rss_large_mb": out["large"]["rss_mb"],
        "rss_small_mb": out["small"]["rss_mb"],
        "rss_diff_mb": out["large"]["rss_mb"] - out["small"]["rss_mb"],
        "rss_target_mb": RSS_TARGET_MB,
        "open_cold_s": out["large"]["open_cold_s"],
        "open_warm_s": out["large"]["open_warm_s"],
        "batches": steps,
        "corpora": out,
    }


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small corpora (smoke test)")
    parser.add_argument("--workers", type=int, default=2, help="tokenizer processes per side")
    parser.add_argument("--rounds", type=int, help="throughput rounds (default 4, quick 2)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument(
        "--part", choices=["all", "throughput", "memory"], default="all", help="what to measure"
    )
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        figures: dict[str, Any] = {}
        if args.part in ("all", "throughput"):
            figures.update(throughput(Path(tmp), args.quick, args.workers, rounds))
            print(
                f"prepare: {figures['prepare_mb_per_s']:.2f} MB/s of text; vs encode_batch "
                f"directly: {figures['prepare_vs_encoder']:.2f}x wall, "
                f"{figures['prepare_vs_encoder_cpu']:.2f}x CPU (target >= 0.8x)"
            )
        if args.part in ("all", "memory"):
            figures.update(memory(Path(tmp), args.quick))
            large, small = figures["corpora"]["large"], figures["corpora"]["small"]
            print(
                f"RSS: {figures['rss_large_mb']:.1f} MB on {large['corpus_mb']:.0f} MB of "
                f"tokens vs {figures['rss_small_mb']:.1f} MB on {small['corpus_mb']:.0f} MB: "
                f"{figures['rss_diff_mb']:+.1f} MB (target within {RSS_TARGET_MB:.0f} MB)"
            )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
