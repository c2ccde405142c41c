"""ZeRO on the engine: per-rank bytes, step time and recovery of stages 0-3 and hpZ.

A GPT of about 50M parameters (``--quick``: under 1M) trains on 4 gloo worker processes
with ``maxFailures`` 1, so ZeRO shards within groups of S = 2 ranks and keeps 2 replica
groups (HSDP 2 x 2). For each mode (stage0, stage1, stage2, stage3; and stage3+hpz2-s4,
where maxFailures 0 leaves one group of 4 shards so hpZ blocks of 2 exist: h must be
smaller than S, and with S = 2 there is no hpZ to measure) one
fresh set of processes runs the engine the way the trainer does (``open_world`` ->
``make_plan`` -> ``build_engine`` -> ``adopt`` -> ``step``) and measures:

- **bytes per rank** of parameters, gradients and optimizer state (fp32 AdamW) against the
  ZeRO formula for the plan (``plan.state_bytes_per_rank``: stage 0 = 16 Psi bytes, stage
  1 shards the optimizer state over S, stage 2 also the gradients, stage 3 also the
  parameters). Two measurements:

  - ``bytes_per_rank``: the local shards (``Engine.state_bytes``: ``to_local()`` bytes of
    the parameters the optimizer owns, of their gradients after backward, of the optimizer
    state), as left by a step;
  - ``peak_bytes_per_rank``: the most a rank holds at a step's sampled moments (before
    each micro-batch after the first, and before and after the optimizer update),
    counting every parameter and gradient tensor the model has registered then too: with
    stages 1 and 2 FSDP2 keeps the whole parameters gathered through the step beside the
    sharded ones, and stage 1 accumulates whole gradients over the micro-batches.

  hpZ's secondary copy (Psi_blocks x 4 / h bytes: 1/h of every decoder-block parameter,
  from a block's forward to its backward) is transient and not sampled; it is reported
  beside the figures as ``hpz_secondary_bytes_formula``, not added to them.
- **step time**: the median of a few steps (engine-measured, rank 0), beside stage 0.
- **recovery**: one worker SIGKILLs itself in the middle of a step (a timer thread, at
  about 40 % of a step); the three survivors catch the failed collective, keep their
  state, form the next generation's world (3 workers and f = 1 leave no room for 2
  replicas of 2 shards: the plan degrades to data parallel, S = 1), build its engine,
  adopt the state from each other and run a step. ``recovery_s`` = the kill to the
  survivors' first completed step; ``adopt_s`` = the kill to ``adopt()`` done;
  ``lost_steps`` = steps committed before the kill that the adopted state lacks (must be
  0). The survivors learn of the loss from the collective, not from a control plane, so
  this is the engine's part of a recovery.

Prints a side-by-side table with ratios; ``--out FILE`` writes ``bytes_per_rank``,
``formula_bytes_per_rank``, ``step_s``, ``recovery_s`` (each a map mode -> figure) and
the raw figures. Targets (issue 12): bytes within 10 % of the formula, recovery <= 3 s,
0 lost steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.world import CollectiveError, open_world
from bulkhead.trainer.parallel.plan import StateBytes, make_plan, zero_plan

WORKERS = 4
MAX_FAILURES = 1
VICTIM = 3  # the slot that is killed
MODES: dict[str, tuple[int, int, int]] = {  # mode -> (ZeRO stage, hpZ size h, maxFailures)
    "stage0": (0, 1, MAX_FAILURES),
    "stage1": (1, 1, MAX_FAILURES),
    "stage2": (2, 1, MAX_FAILURES),
    "stage3": (3, 1, MAX_FAILURES),
    # maxFailures 0: one group of S = 4 shards, so h = 2 keeps a real secondary copy.
    # No replica survives a kill (the engine would restore the checkpoint): no recovery.
    "stage3+hpz2-s4": (3, 2, 0),
}
# About 50.5M parameters: 16 blocks of 3.15M (d 512, ffn 2048), byte vocabulary.
FULL_MODEL = {"dModel": 512, "nLayers": 16, "nHeads": 8, "seqLen": 32, "ffnDim": 2048}
QUICK_MODEL = {"dModel": 128, "nLayers": 4, "nHeads": 4, "seqLen": 32, "ffnDim": 512}
# 8 sequences over 4 ranks in micro-batches of 1: two micro-batches per rank, so stage 1's
# gradient accumulation (reduced on the last micro-batch only) shows.
BATCH = {"globalBatchSize": 8, "microBatchSize": 1}
KILL_AT_FRACTION = 0.4  # of the median step time, into the step the victim dies in


def config(
    stage: int, hpz: int, max_failures: int, model: dict[str, int], timeout_s: float
) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": WORKERS,
            "trainer": {
                "model": model,
                "batch": BATCH,
                "steps": 1000,
                "parallelism": {"zero": {"stage": stage, "hpzPartitionSize": hpz}},
            },
            "faultTolerance": {
                "maxFailures": max_failures,
                "collectiveTimeoutSeconds": timeout_s,
            },
        }
    )
    return train_config(spec)


# -- measuring bytes -------------------------------------------------------------------


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class BytesProbe:
    """Samples the model state one rank holds at moments of a step (hooks, public APIs).

    Parameters: those the optimizer owns plus those the model has registered at the
    moment (FSDP2 registers the gathered whole ones while it keeps them), each once;
    gradients: theirs; optimizer state: the per-parameter slots (AdamW's two moments).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.samples: list[tuple[str, StateBytes]] = []
        # Decoder-block parameters registered after forward that the optimizer does not
        # own: hpZ's secondary copy (stage 3 + hpZ), the whole gathered ones (stages 1, 2).
        self.block_extra_after_forward = 0
        self._passes = 0
        self._handles: list[Any] = []

    def sample(self, where: str) -> None:
        params: dict[int, torch.Tensor] = {}
        for group in self.engine.optimizer.param_groups:
            for p in group["params"]:
                params[id(p)] = p
        owned = set(params)
        for p in self.engine.model.parameters():
            params[id(p)] = p
        if where.startswith("after forward"):
            extra = sum(
                _nbytes(p)
                for name, p in self.engine.model.named_parameters()
                if name.startswith("blocks.") and id(p) not in owned
            )
            self.block_extra_after_forward = max(self.block_extra_after_forward, extra)
        optimizer = sum(
            _nbytes(v)
            for slots in self.engine.optimizer.state.values()
            for v in slots.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        self.samples.append(
            (
                where,
                StateBytes(
                    params=sum(_nbytes(p) for p in params.values()),
                    grads=sum(_nbytes(p.grad) for p in params.values()),
                    optimizer=optimizer,
                ),
            )
        )

    def __enter__(self) -> BytesProbe:
        def before_forward(*_: object) -> None:
            self._passes += 1
            if self._passes > 1:  # the previous micro-batch's backward is done
                self.sample(f"before micro-batch {self._passes}")

        def after_forward(*_: object) -> None:  # runs after FSDP2's own post-forward
            self.sample(f"after forward {self._passes}")

        model, optimizer = self.engine.model, self.engine.optimizer
        self._handles = [
            model.register_forward_pre_hook(before_forward, prepend=True),
            model.register_forward_hook(after_forward),
            optimizer.register_step_pre_hook(lambda *_: self.sample("before update")),
            optimizer.register_step_post_hook(lambda *_: self.sample("after update")),
        ]
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()

    def peak(self) -> tuple[str, StateBytes]:
        return max(self.samples, key=lambda s: s[1].total)


def _as_dict(b: StateBytes) -> dict[str, int]:
    return {"params": b.params, "grads": b.grads, "optimizer": b.optimizer, "total": b.total}


# -- one worker process ----------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    mode: str
    cfg: TrainConfig
    kill: bool
    port: int
    out_dir: str
    timed_steps: int
    after_steps: int
    timeout_s: float


def _arm_kill(delay_s: float, out_dir: str) -> None:
    """SIGKILL this process ``delay_s`` from now, recording the wall-clock time first."""

    def fire() -> None:
        Path(out_dir, "kill.json").write_text(json.dumps({"t": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Timer(delay_s, fire).start()


def _worker(slot: int, job: Job) -> None:
    torch.set_num_threads(1)
    cfg = job.cfg
    store = dist.TCPStore(
        "127.0.0.1", job.port, None, False, timedelta(seconds=job.timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    dataset = open_dataset(cfg)
    device = pick_device()
    workers = [f"w{s}" for s in range(WORKERS)]
    record: dict[str, Any] = {"slot": slot}

    world = open_world(1, slot, workers, workers, store, device, job.timeout_s)
    plan = make_plan(1, workers, workers, cfg)
    engine = build_engine(plan, world, cfg)
    engine.adopt(None)
    record["plan"] = plan.describe()

    with BytesProbe(engine) as probe:  # step 0: sampled, not timed (first-step set-up)
        engine.step(dataset)
    held, formula = engine.state_bytes()
    where, peak = probe.peak()
    record |= {
        "num_params": sum(s.numel for s in engine.specs if s.name.startswith("param/")),
        "block_params": sum(s.numel for s in engine.specs if s.name.startswith("param/blocks.")),
        "local_shards": _as_dict(held),
        "formula": _as_dict(formula),
        "peak": _as_dict(peak),
        "peak_at": where,
        "block_extra_after_forward": probe.block_extra_after_forward,
        "samples": [(w, _as_dict(b)) for w, b in probe.samples],
    }

    step_s = [engine.step(dataset).seconds for _ in range(job.timed_steps)]
    record["step_s"] = step_s
    if not job.kill:
        world.close()
        Path(job.out_dir, f"slot{slot}.json").write_text(json.dumps(record))
        return

    # The kill: the victim dies inside its next step; the survivors' step fails.
    if slot == VICTIM:
        _arm_kill(KILL_AT_FRACTION * statistics.median(step_s), job.out_dir)
    try:
        for _ in range(1000):
            engine.step(dataset)
        raise RuntimeError("no step failed after the kill")
    except CollectiveError as exc:
        record["failed_t"] = time.time()
        record["error"] = str(exc)[:300]
    committed = engine.completed_steps
    kept = engine.held_state()
    world.close()

    survivors = [w for i, w in enumerate(workers) if i != VICTIM]
    rank = survivors.index(f"w{slot}")
    world = open_world(2, rank, survivors, survivors, store, device, job.timeout_s)
    plan = make_plan(2, survivors, survivors, cfg)
    engine = build_engine(plan, world, cfg, initialize=False)  # as the runtime: it holds state
    adoption = engine.adopt(kept)
    record["adopted_t"] = time.time()
    first = engine.step(dataset)
    record["first_step_t"] = time.time()
    record |= {
        "committed_before_kill": committed,
        "adopted_step": adoption.step,
        "adoption": adoption.source,
        "adopt_bytes_received": adoption.bytes_received,
        "adopt_seconds": adoption.seconds,
        "plan_after": plan.describe(),
        "first_step_after": first.step,
        "first_step_after_s": first.seconds,
        "after_step_s": [engine.step(dataset).seconds for _ in range(job.after_steps)],
    }
    world.close()
    Path(job.out_dir, f"slot{slot}.json").write_text(json.dumps(record))


# -- the parent ------------------------------------------------------------------------


def run_mode(job_args: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One mode on fresh processes: returns every slot's record and the kill time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=job_args["timeout_s"]))
    job = Job(port=store.port, out_dir=str(out_dir), **job_args)
    ctx = mp.get_context("spawn")
    procs = {s: ctx.Process(target=_worker, args=(s, job)) for s in range(WORKERS)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=1800)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    codes = {s: p.exitcode for s, p in procs.items()}
    victim = VICTIM if job.kill else None
    if job.kill and codes[VICTIM] != -signal.SIGKILL:
        raise RuntimeError(f"{job.mode}: the victim exited {codes[VICTIM]}, not by SIGKILL")
    bad = {s: c for s, c in codes.items() if s != victim and c != 0}
    if bad:
        raise RuntimeError(f"{job.mode}: workers failed with exit codes {bad}")
    records = {s: json.loads((out_dir / f"slot{s}.json").read_text()) for s in codes if s != victim}
    kill_t = json.loads((out_dir / "kill.json").read_text())["t"] if job.kill else None
    return {"records": records, "kill_t": kill_t}


def summarize(mode: str, run: dict[str, Any]) -> dict[str, Any]:
    records, kill_t = run["records"], run["kill_t"]
    first = records[0]
    survivors = list(records.values())
    # The victim's own record died with it: bytes are the largest over the survivors.
    local = max((r["local_shards"] for r in survivors), key=lambda b: b["total"])
    peak = max((r["peak"] for r in survivors), key=lambda b: b["total"])
    figures = {
        "mode": mode,
        "plan": first["plan"],
        "num_params": first["num_params"],
        "block_params": first["block_params"],
        "local_shards": local,
        "peak": peak,
        "peak_at": first["peak_at"],
        "formula": first["formula"],
        "step_s": statistics.median(first["step_s"]),
        "step_samples_s": first["step_s"],
        "block_extra_after_forward": max(r["block_extra_after_forward"] for r in survivors),
    }
    if kill_t is None:
        return figures
    return figures | {
        "plan_after_kill": first["plan_after"],
        "detect_s": max(r["failed_t"] for r in survivors) - kill_t,
        "adopt_s": max(r["adopted_t"] for r in survivors) - kill_t,
        "recovery_s": max(r["first_step_t"] for r in survivors) - kill_t,
        "adopt_only_s": max(r["adopt_seconds"] for r in survivors),
        # Closing the failed world, forming the next and building its engine.
        "rebuild_s": max(r["adopted_t"] - r["failed_t"] - r["adopt_seconds"] for r in survivors),
        "adoption": sorted({r["adoption"] for r in survivors}),
        "adopt_bytes_received": {r["slot"]: r["adopt_bytes_received"] for r in survivors},
        "lost_steps": max(r["committed_before_kill"] for r in survivors)
        - min(r["adopted_step"] for r in survivors),
        "first_step_after_kill": first["first_step_after"],
        "step_after_kill_s": first["after_step_s"],
    }


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the figures as JSON here.")
    parser.add_argument("--quick", action="store_true", help="A model under 1M parameters.")
    parser.add_argument("--modes", default=",".join(MODES), help="Comma-separated modes.")
    parser.add_argument("--timeout", type=float, default=60.0, help="Collective timeout, s.")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    model = QUICK_MODEL if args.quick else FULL_MODEL
    timed, after = (2, 1) if args.quick else (3, 1)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        for mode in modes:
            stage, hpz, max_failures = MODES[mode]
            job_args = {
                "mode": mode,
                "cfg": config(stage, hpz, max_failures, model, args.timeout),
                "kill": max_failures > 0,
                "timed_steps": timed,
                "after_steps": after,
                "timeout_s": args.timeout,
            }
            t0 = time.monotonic()
            results[mode] = summarize(mode, run_mode(job_args, Path(tmp, mode)))
            print(f"  {mode}: done in {time.monotonic() - t0:.0f} s", flush=True)
    wall = time.monotonic() - started
    report(results, model, wall, args.out)


def hpz_secondary_formula(mode: str, block_params: int) -> int:
    """Bytes of hpZ's secondary copy per rank: 4 x block parameters / h (0 without one).

    h equal to the shard group size is plain stage 3 in FSDP2 (nothing beyond the shard).
    """
    stage, hpz, max_failures = MODES[mode]
    plan = zero_plan(stage, hpz, WORKERS, max_failures)
    if plan.hpz <= 1 or plan.hpz == plan.shard_size:
        return 0
    return 4 * block_params // plan.hpz


def report(
    results: dict[str, dict[str, Any]], model: dict[str, int], wall: float, out: Path | None
) -> None:
    any_result = next(iter(results.values()))
    psi, blocks = any_result["num_params"], any_result["block_params"]
    base = results.get("stage0", {}).get("step_s")
    mib = float(1 << 20)
    print(
        f"\nZeRO on the engine: {psi / 1e6:.1f}M parameters (fp32 AdamW), {WORKERS} gloo "
        f"workers; maxFailures {MAX_FAILURES} = 2 replica groups x 2 shards (the -s4 mode: "
        "maxFailures 0, 1 x 4); MiB per rank"
    )
    print(
        f"{'mode':15} {'shards':>7} {'formula':>7} {'ratio':>5} {'peak':>7} {'ratio':>5}"
        f" {'step s':>7} {'/st0':>5} {'detect':>6} {'adopt':>6} {'recov':>6} {'lost':>4}"
    )

    def fmt(r: dict[str, Any], key: str, spec: str) -> str:
        width = int(spec.split(".")[0].rstrip("df"))
        return format(r[key], spec) if key in r else f"{'-':>{width}}"

    secondary = {m: hpz_secondary_formula(m, blocks) for m in results}
    # The peak is compared with the formula plus hpZ's transient secondary copy.
    peak_formula = {m: r["formula"]["total"] + secondary[m] for m, r in results.items()}
    for mode, r in results.items():
        formula = r["formula"]["total"]
        ratio_step = f"{r['step_s'] / base:5.2f}" if base else "    -"
        print(
            f"{mode:15} {r['local_shards']['total'] / mib:7.1f} {formula / mib:7.1f}"
            f" {r['local_shards']['total'] / formula:5.2f} {r['peak']['total'] / mib:7.1f}"
            f" {r['peak']['total'] / peak_formula[mode]:5.2f} {r['step_s']:7.2f} {ratio_step}"
            f" {fmt(r, 'detect_s', '6.2f')} {fmt(r, 'adopt_s', '6.2f')}"
            f" {fmt(r, 'recovery_s', '6.2f')} {fmt(r, 'lost_steps', '4d')}"
        )
    print("\nper component, MiB: local shards / peak / formula; extra block params after forward")
    for mode, r in results.items():
        parts = "  ".join(
            f"{k} {r['local_shards'][k] / mib:.1f}/{r['peak'][k] / mib:.1f}/"
            f"{r['formula'][k] / mib:.1f}"
            for k in ("params", "grads", "optimizer")
        )
        extra = r["block_extra_after_forward"] / mib
        print(f"  {mode:15} {parts}  extra {extra:.1f} (hpZ formula {secondary[mode] / mib:.1f})")
    print(
        "shards = Engine.state_bytes (to_local of the optimizer's parameters, their gradients,"
        " the optimizer state); peak = most held at a sampled moment of a step, gathered"
        " parameters and accumulated gradients included, against the formula plus hpZ's"
        " secondary copy; extra = decoder-block parameters"
        " registered after forward that the optimizer does not own (hpZ's secondary copy,"
        " or the whole parameters stages 1/2 keep gathered)"
    )
    print(
        "recovery: kill -> survivors' first completed step in the 3-worker generation "
        "(data parallel); adopt: kill -> adopt() done; detect: kill -> failed collective"
    )
    for mode, r in results.items():
        if "rebuild_s" in r:
            first_step = r["recovery_s"] - r["adopt_s"]
            print(
                f"  {mode:15} after detection: new world + engine {r['rebuild_s']:.2f} s, "
                f"adopt() {r['adopt_only_s']:.2f} s, first step {first_step:.2f} s"
            )
    print(f"wall {wall:.0f} s; targets: bytes within 10 % of the formula, recovery <= 3 s")

    def by_mode(key: str, digits: int = 3) -> dict[str, float]:
        return {m: round(r[key], digits) for m, r in results.items() if key in r}

    figures = {
        "bytes_per_rank": {m: r["local_shards"]["total"] for m, r in results.items()},
        "formula_bytes_per_rank": {m: r["formula"]["total"] for m, r in results.items()},
        "peak_bytes_per_rank": {m: r["peak"]["total"] for m, r in results.items()},
        "bytes_ratio": {
            m: round(r["local_shards"]["total"] / r["formula"]["total"], 3)
            for m, r in results.items()
        },
        "peak_formula_bytes_per_rank": peak_formula,
        "peak_bytes_ratio": {
            m: round(r["peak"]["total"] / peak_formula[m], 3) for m, r in results.items()
        },
        "hpz_secondary_bytes": {m: r["block_extra_after_forward"] for m, r in results.items()},
        "hpz_secondary_bytes_formula": secondary,
        "step_s": by_mode("step_s"),
        "step_vs_stage0": (
            {m: round(r["step_s"] / base, 3) for m, r in results.items()} if base else {}
        ),
        "recovery_s": by_mode("recovery_s"),
        "adopt_s": by_mode("adopt_s"),
        "detect_s": by_mode("detect_s"),
        "rebuild_s": by_mode("rebuild_s"),
        "adopt_only_s": by_mode("adopt_only_s"),
        "lost_steps": {m: r["lost_steps"] for m, r in results.items() if "lost_steps" in r},
        "num_params": psi,
        "model": model,
        "batch": BATCH,
        "workers": WORKERS,
        "wall_s": round(wall, 1),
        "raw": results,
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
