"""Per-rank memory of multi-rank layouts: what each rank holds against ``bulkhead plan``.

Shared by ``bench/precision.py`` (its layout rows). For each layout (data parallel,
ZeRO-1/2/3, a 1F1B pipeline, expert parallelism) and precision, one process per rank
(gloo on the CPU, forked from the fork server of ``_engine_runs``) forms generation 1 and
builds the engine exactly as a worker does (``build_engine`` on ``make_plan``), trains one
step, then measures during a second step:

- parameters, gradients and optimizer state: the bytes of the tensors the engine holds
  between steps (``Engine.state_bytes``: the local shards);
- activations: the most bytes of distinct storages autograd holds for backward at once
  (``saved_tensors_hooks`` on the whole step; a storage counts from the pass that saves
  it until autograd lets go of the last tensor saved on it). Parameters are excluded as
  the module holds them at the moment of saving: under ZeRO FSDP2's gathered parameters,
  which are transient state, not activations (autocast's bf16 copies of weights are
  included: they live as long as the activations).

The prediction is the planner's (``parallel.rank_memory.rank_memory``), the same
``bulkhead plan`` prints per rank, computed from the plan of the same membership.
"""

from __future__ import annotations

import queue as queues
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _engine_runs import _open, device_for, process_context
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.groups import group_sizes
from bulkhead.trainer.engine.state import _local
from bulkhead.trainer.parallel.plan import make_plan
from bulkhead.trainer.parallel.rank_memory import rank_memory

RANKS = 2
# (name, family, spec.trainer.parallelism): every layout of the engine on RANKS ranks.
LAYOUTS = [
    ("data parallel", "llama", {}),
    ("ZeRO-1", "llama", {"zero": {"stage": 1}}),
    ("ZeRO-2", "llama", {"zero": {"stage": 2}}),
    ("ZeRO-3", "llama", {"zero": {"stage": 3}}),
    ("pipeline 1F1B", "llama", {"pipeline": {"minStages": 2}}),
    ("experts", "mixtral", {"experts": {"minReplicas": 1}}),
]
KINDS = ("params", "grads", "optimizer", "activations")


def layout_config(quick: bool, family: str, parallelism: dict[str, Any], precision: str) -> Any:
    """One copy of the state (maxFailures 0: ZeRO shards over both ranks, one pipeline
    of two stages, every expert on one rank); 4 micro-batches of 2 per step."""
    spec = TrainingJobSpec.model_validate(
        {
            "workers": RANKS,
            "trainer": {
                "model": {"family": family, "preset": "tiny" if quick else "small"},
                "batch": {"globalBatchSize": 8, "microBatchSize": 2},
                "precision": precision,
                "parallelism": parallelism,
            },
            "faultTolerance": {"maxFailures": 0, "collectiveTimeoutSeconds": 60},
        }
    )
    return train_config(spec)


class SavedPeak:
    """The most bytes of distinct non-parameter storages autograd holds at once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors saved]
        self.held = 0
        self.peak = 0

    def _parameters(self) -> set[int]:
        # Read at every save: FSDP2 swaps a module's sharded parameters for gathered ones.
        return {
            _local(p).untyped_storage().data_ptr() for p in self.model.parameters() if not p.is_meta
        }

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        params = self._parameters()
        for inner in _plain(t):
            self._save(t, inner, params)
        return t

    def _save(self, t: torch.Tensor, inner: torch.Tensor, params: set[int]) -> None:
        storage = inner.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in params:
            return
        entry = self.live.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.held += entry[0]
            self.peak = max(self.peak, self.held)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.held -= entry[0]
            del self.live[ptr]


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a wrapper subclass's inner ones
    (the functional all-to-all returns an ``AsyncCollectiveTensor``)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in _plain(getattr(t, name))]


def _rank(slot: int, cfg: TrainConfig, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    world, engine = _open(1, slot, list(range(RANKS)), store, device_for(slot, "cpu"), cfg)
    try:
        engine.adopt(None)
        dataset = open_dataset(cfg)
        engine.step(dataset)  # the first step allocates the optimizer state
        peak = SavedPeak(engine.model)
        with torch.autograd.graph.saved_tensors_hooks(peak.pack, lambda t: t):
            engine.step(dataset)
        held, _ = engine.state_bytes()
        results.put(
            {
                "rank": slot,
                "params": held.params,
                "grads": held.grads,
                "optimizer": held.optimizer,
                "activations": peak.peak,
            }
        )
    finally:
        world.close()


def predicted(cfg: TrainConfig) -> list[dict[str, int]]:
    """What ``bulkhead plan`` predicts for every rank of the layout."""
    workers = [f"w{s}" for s in range(RANKS)]
    plan = make_plan(1, workers, workers, cfg)
    per_group = group_sizes(cfg.family, cfg.model, plan.experts is not None)
    out = []
    for rank in range(RANKS):
        m = rank_memory(plan, cfg.shape, per_group, rank, cfg.precision,
                        cfg.activation_checkpointing)  # fmt: skip
        out.append({"params": m.state.params, "grads": m.state.grads,
                    "optimizer": m.state.optimizer, "activations": m.activations})  # fmt: skip
    return out


def measure(cfg: TrainConfig, timeout_s: float = 600) -> list[dict[str, int]]:
    """Every rank's measured bytes (by rank), from fresh processes."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    ctx = process_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(s, cfg, store.port, results)) for s in range(RANKS)]
    got: dict[int, dict[str, int]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(got) < RANKS:
            if time.monotonic() > deadline:
                raise SystemExit(f"a layout's ranks took more than {timeout_s:g} s")
            try:
                r = results.get(timeout=1)
                got[r.pop("rank")] = r
            except queues.Empty:
                dead = [s for s, p in enumerate(procs) if s not in got and not p.is_alive()]
                if dead:
                    raise SystemExit(f"rank(s) {dead} exited (traceback above)") from None
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[s] for s in range(RANKS)]


def layout_rows(quick: bool) -> list[dict[str, Any]]:
    """Measured against predicted per rank for every layout in fp32 and bf16."""
    rows = []
    for name, family, parallelism in LAYOUTS:
        for precision in ("fp32", "bf16"):
            cfg = layout_config(quick, family, parallelism, precision)
            want = predicted(cfg)
            for rank, got in enumerate(measure(cfg)):
                ratio = {k: got[k] / want[rank][k] if want[rank][k] else None for k in KINDS}
                rows.append({"layout": name, "family": family, "precision": precision,
                             "rank": rank, "measured": got, "predicted": want[rank],
                             "ratio": ratio})  # fmt: skip
    return rows
