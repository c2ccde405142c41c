"""Oobleck pipelines of one generation: which rank runs which stage of which pipeline.

A pipeline stage holds a contiguous range of *units*: 0 is the embedding (token and
position), 1..L the decoder blocks, L+1 the head (final norm and output projection,
whose weight is the token embedding's: the first and the last stage of every pipeline
both hold it). The planners of ``trainer.planning`` give the fastest template (stage
layout) for every worker count; ``plan_pipelines`` instantiates at least f + 1 of them
over the generation's ranks, in rank order, and splits the global batch's micro-batches
among them so they finish together. Every unit is thus held by one rank of every
pipeline, f + 1 copies: any f losses leave a holder of each.

A stage is one worker pod. A pod of G trainer processes (``width``) runs its stage on
all of them: each process takes 1/G of every micro-batch and sends its activations to
the process of the same local rank in the next stage; the stage's state is sharded over
the pod's processes by FSDP2 under ZeRO, else held by each of them.

The costs are the analytic model of ``planning.costs`` for a device of one GPU per
stage process, at the per-process micro-batch: pure, so every rank computes the same
plan with no byte exchanged. When the
workers are too few for f + 1 pipelines of ``minStages``, fewer pipelines run (fewer
copies, said in ``describe``); a rank no template can use stays idle (it holds nothing
and only joins the step's agreement).

No torch here: ``bulkhead plan`` and the tests import it freely.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulkhead.trainer.config import PipelineParallelism
from bulkhead.trainer.planning.costs import GpuSpec, LayerCost, ModelShape, estimate_layer_costs
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.instantiate import Instantiation, instantiate
from bulkhead.trainer.planning.templates import TemplateSet, generate_templates

# One GPU per worker (one trainer process per pod); the analytic costs only rank layouts.
PLANNING_DEVICE = GpuSpec(gpus_per_node=1)
TIED = "unit/tied"  # the key group of the token embedding, which the head also uses


def unit_group(unit: int) -> str:
    """The key group of one unit's parameters and optimizer state."""
    return f"unit/{unit}"


@dataclass(frozen=True)
class StagePlan:
    """One stage: units [start, stop) of pipeline ``pipeline`` on the worker pod whose
    first rank is ``rank`` (its ``width`` processes are ranks ``rank`` .. ``rank+width-1``)."""

    pipeline: int
    index: int  # position in its pipeline
    stages: int  # stages of its pipeline
    start: int
    stop: int
    rank: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


@dataclass(frozen=True)
class PipelineLayout:
    """The pipelines of one generation; identical on every rank."""

    num_units: int
    schedule: str  # "1F1B" | "GPipe"
    stages: tuple[tuple[StagePlan, ...], ...]  # per pipeline, its stages in order
    microbatches: tuple[tuple[int, int], ...]  # per pipeline: (first global micro-batch, count)
    micro_batch_size: int
    global_batch_size: int
    copies: int  # pipelines: holders of every unit
    requested_copies: int  # maxFailures + 1
    predicted_iteration_s: float
    idle: tuple[int, ...] = ()  # ranks no template uses: they hold nothing
    # Planned seconds of forward + backward of one micro-batch through each unit (the
    # planner's analytic costs): what a stage's busy time is compared against.
    unit_seconds: tuple[float, ...] = ()
    width: int = 1  # processes per stage (per worker pod)

    def stage(self, rank: int) -> StagePlan | None:
        """Rank ``rank``'s stage (None: idle)."""
        first = rank - rank % self.width
        return next((s for p in self.stages for s in p if s.rank == first), None)

    def peer(self, rank: int, offset: int) -> int:
        """The rank of the same local rank in the stage ``offset`` places along rank
        ``rank``'s pipeline (the one its activations go to or come from)."""
        stage = self.stage(rank)
        assert stage is not None, f"rank {rank} runs no stage"
        return self.stages[stage.pipeline][stage.index + offset].rank + rank % self.width

    def rows(self, pipeline: int, rank: int) -> list[list[int]]:
        """Rank ``rank``'s part of each of ``pipeline``'s micro-batches: 1/width of its
        samples, consecutive (the spec makes micro-batches divisible by the width)."""
        local, width = rank % self.width, self.width
        out = []
        for samples in self.batches(pipeline):
            size = -(-len(samples) // width)
            out.append(samples[local * size : (local + 1) * size])
        return out

    def units(self, rank: int) -> range:
        s = self.stage(rank)
        return range(s.start, s.stop) if s is not None else range(0)

    def work(self, rank: int) -> float:
        """Planned busy seconds of rank ``rank`` in one step (0 when idle)."""
        stage = self.stage(rank)
        if stage is None or not self.unit_seconds:
            return 0.0
        per_batch = sum(self.unit_seconds[u] for u in range(stage.start, stage.stop))
        return per_batch * self.microbatches[stage.pipeline][1]

    def work_scale(self, rank: int) -> float:
        """Factor that makes rank ``rank``'s busy time comparable with the other ranks':
        stages differ in work by design (units, micro-batches), so a straggler check on
        raw times would flag the busiest stage. 0 for an idle rank (no evidence)."""
        mine = self.work(rank)
        planned = [self.work(s.rank) for p in self.stages for s in p]
        return sum(planned) / len(planned) / mine if mine > 0 else 0.0

    def ranks_of(self, stage: StagePlan) -> range:
        return range(stage.rank, stage.rank + self.width)

    def groups(self, rank: int) -> frozenset[str]:
        """The key groups rank ``rank`` holds."""
        units = self.units(rank)
        out = {unit_group(u) for u in units}
        if 0 in units or self.num_units - 1 in units:
            out.add(TIED)
        return frozenset(out)

    def holders(self, group: str) -> tuple[int, ...]:
        """Ranks holding (some of) ``group``, ascending: every process of its stages."""
        ranks = sorted(r for p in self.stages for s in p for r in self.ranks_of(s))
        return tuple(r for r in ranks if group in self.groups(r))

    def batches(self, pipeline: int) -> list[list[int]]:
        """Pipeline ``pipeline``'s micro-batches as sample offsets into the global batch."""
        first, count = self.microbatches[pipeline]
        mbs, gb = self.micro_batch_size, self.global_batch_size
        return [list(range(j * mbs, min((j + 1) * mbs, gb))) for j in range(first, first + count)]

    def describe(self, workers: tuple[str, ...] | None = None) -> list[str]:
        def name(rank: int) -> str:
            return workers[rank] if workers is not None else f"rank {rank}"

        sizes = "+".join(str(len(p)) for p in self.stages)
        survive = self.copies - 1
        lines = [
            f"Oobleck pipelines: {len(self.stages)} ({sizes} stages, {self.schedule}); every "
            f"layer on {self.copies} worker(s) (survives {survive} loss(es))"
        ]
        if self.width > 1:
            lines.append(
                f"each stage runs on its worker's {self.width} processes, 1/{self.width} of "
                "every micro-batch each"
            )
        if self.copies < self.requested_copies:
            lines.append(
                f"fewer copies than maxFailures + 1 = {self.requested_copies}: too few "
                "workers for that many pipelines"
            )
        for p, stages in enumerate(self.stages):
            samples = sum(len(b) for b in self.batches(p))
            parts = " | ".join(f"{name(s.rank)} units {s.start}-{s.stop - 1}" for s in stages)
            lines.append(
                f"pipeline {p}: {len(stages)} stage(s), {self.microbatches[p][1]} micro-batch(es) "
                f"= {samples} samples: {parts}"
            )
        if self.idle:
            idle = dict.fromkeys(name(r) for r in self.idle)
            lines.append(f"idle (no template uses them): {', '.join(idle)}")
        return lines


def unit_costs(
    model: ModelShape, micro_batch_size: int, precision: str, checkpointing: str
) -> list[LayerCost]:
    """The planner's costs of the units, one (per-process) micro-batch each."""
    return estimate_layer_costs(model, PLANNING_DEVICE, micro_batch_size, precision, checkpointing)


def template_set(
    model: ModelShape,
    pp: PipelineParallelism,
    ranks: int,
    micro_batch_size: int,
    precision: str = "fp32",
    checkpointing: str = "none",
) -> TemplateSet:
    """Templates for every pipeline length the spec allows on ``ranks`` workers."""
    units = len(model.units)
    lo = min(pp.min_stages, ranks, units)
    hi = min(pp.max_stages or units, ranks, units)
    hi = max(hi, lo)
    layers = unit_costs(model, micro_batch_size, precision, checkpointing)
    found = generate_templates(layers, PLANNING_DEVICE, hi)
    kept = tuple(t for t in found.templates if lo <= t.num_nodes <= hi)
    if not kept:
        raise PlanError(f"no pipeline template of {lo}..{hi} stages fits the model")
    return TemplateSet(kept, found.num_layers, found.gpus_per_node)


def plan_pipelines(
    ranks: int,
    model: ModelShape,
    pp: PipelineParallelism,
    max_failures: int,
    global_batch_size: int,
    micro_batch_size: int,
    width: int = 1,
    precision: str = "fp32",
    checkpointing: str = "none",
) -> PipelineLayout:
    """The pipelines of a generation of ``ranks`` ranks, worker pods of ``width``
    consecutive ranks each (see the module docstring).

    Fault tolerance comes first: the most copies (up to f + 1) that some number of the
    workers can form, then as many workers as can be used at that many copies.
    """
    if ranks % width:
        raise PlanError(f"{ranks} ranks are not whole worker pods of {width} processes")
    workers = ranks // width
    per_process = max(1, micro_batch_size // width)
    templates = template_set(model, pp, workers, per_process, precision, checkpointing)
    microbatches = -(-global_batch_size // micro_batch_size)
    names = [str(w) for w in range(workers)]
    chosen: Instantiation | None = None
    for f in range(min(max_failures, microbatches - 1), -1, -1):
        for used in range(ranks, 0, -1):
            try:
                chosen = instantiate(templates, names[:used], f, microbatches)
            except PlanError:
                continue
            break
        if chosen is not None:
            break
    if chosen is None:
        raise PlanError(f"{workers} workers cannot form any pipeline of the allowed lengths")
    stages, batches, cursor = [], [], 0
    for p, pipe in enumerate(chosen.pipelines):
        stages.append(
            tuple(
                StagePlan(
                    p,
                    i,
                    pipe.template.num_stages,
                    s.layer_start,
                    s.layer_end,
                    int(ranks_[0]) * width,
                )
                for i, (s, ranks_) in enumerate(
                    zip(pipe.template.stages, pipe.stage_ranks, strict=True)
                )
            )
        )
        batches.append((cursor, pipe.microbatches))
        cursor += pipe.microbatches
    used_ranks = {s.rank + local for p in stages for s in p for local in range(width)}
    return PipelineLayout(
        num_units=templates.num_layers,
        schedule=pp.schedule,
        stages=tuple(stages),
        microbatches=tuple(batches),
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        copies=len(stages),
        requested_copies=max_failures + 1,
        predicted_iteration_s=chosen.iteration_time_s,
        idle=tuple(r for r in range(ranks) if r not in used_ranks),
        unit_seconds=tuple(
            c.compute_s for c in unit_costs(model, per_process, precision, checkpointing)
        ),
        width=width,
    )


def schedule(kind: str, stages: int, index: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of one stage's forward ("F", i) and backward ("B", i) passes.

    1F1B: ``stages - index - 1`` warm-up forwards (the passes in flight downstream), then
    one forward and one backward alternately, then the remaining backwards. GPipe: every
    forward, then every backward in reverse. Receives follow the order the neighbouring
    stage produces; ``p2p_program`` turns the passes into hand-offs that cannot deadlock
    even where a send blocks until its receive is posted (NCCL).
    """
    if kind == "GPipe":
        return [("F", i) for i in range(microbatches)] + [
            ("B", i) for i in reversed(range(microbatches))
        ]
    warmup = min(stages - index - 1, microbatches)
    ops = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < microbatches:
        ops += [("F", forward), ("B", backward)]
        forward += 1
        backward += 1
    ops += [("B", i) for i in range(backward, microbatches)]
    return ops


@dataclass(frozen=True)
class UnitFetch:
    """After a membership change, ``worker`` needs ``unit``, which it did not hold; the
    surviving ``holders`` have it (none: it comes from the checkpoint)."""

    worker: str
    unit: int
    holders: tuple[str, ...]


def unit_fetches(
    old: PipelineLayout,
    old_workers: tuple[str, ...],
    new: PipelineLayout,
    new_workers: tuple[str, ...],
) -> list[UnitFetch]:
    """What moves when ``old``'s survivors (those in ``new_workers``) form ``new``."""
    survivors = set(new_workers)
    held = {w: set(old.units(r)) for r, w in enumerate(old_workers)}
    fetches = []
    for rank, worker in enumerate(new_workers):
        if rank % new.width:  # a pod's processes fetch the same units (their shards)
            continue
        for unit in new.units(rank):
            if unit in held.get(worker, set()):
                continue
            holders = tuple(
                dict.fromkeys(
                    w for r, w in enumerate(old_workers) if w in survivors and unit in old.units(r)
                )
            )
            fetches.append(UnitFetch(worker, unit, holders))
    return fetches
