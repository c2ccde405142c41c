"""What one rank of a plan holds: training state between steps and activations in a step.

``rank_memory(plan, shape, per_group, rank, precision, checkpointing)`` is the planner's
per-rank prediction that ``bulkhead plan`` prints for every rank of every layout and
``bench/precision.py`` measures against the trainer:

- state (``rank_state``): the fp32 parameters, gradients and ``slots`` AdamW values of
  every key group the rank holds (``per_group``: ``engine.groups.group_sizes``): every
  group under data parallelism and ZeRO, the stage's units under pipelines, the dense
  groups plus the hosted experts under expert parallelism. Where FSDP2 shards them (ZeRO,
  hosted experts excepted) the rank keeps 1/S of each between steps, in every stage:
  FSDP2 reshards parameters and reduce-scatters gradients after every backward (stages 1
  and 2 gather the whole parameters only inside a step: ``state_bytes_per_rank``).
- activations (``rank_activations``): the most autograd keeps for backward at once in a
  step. A rank running the whole model keeps one micro-batch (its largest: the rank's
  share of the global batch in passes of microBatchSize); a pipeline stage keeps its
  units' activations of every micro-batch in flight (GPipe: all of its pipeline's,
  1F1B: at most ``stages - index``), of its rows of each (1/width under a pod of several
  processes). A unit's bytes per pass are ``costs.activation_bytes``; under bf16 that
  includes autocast's bf16 copy of every weight the unit multiplies by, which exists only
  where autocast casts: not under FSDP2, which gathers the weights in bf16 already (the
  gathered copies are transient parameters, not saved activations; the projections'
  inputs are bf16 then, so autocast casts none and the norms' outputs are bf16), and
  only for the experts a rank hosts. Expert parallelism keeps each routed token once
  more, as its expert received it. Routing is taken as balanced: a rank's experts
  receive its own tokens' share. Not modelled: the dispatch may put up to
  (1 + ``concentrationSlack``) x Alg. 1's busiest rank's rows on a rank
  (``planning.dispatch_quotas``), and skewed routing more.

No torch here: ``bulkhead plan`` and the tests import it freely.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulkhead.trainer.parallel.experts_plan import expert_group
from bulkhead.trainer.parallel.pipeline_plan import schedule
from bulkhead.trainer.parallel.plan import ParallelPlan, StateBytes
from bulkhead.trainer.planning.costs import (
    ACTIVATION_BYTES,
    GRAD_BYTES,
    OPTIMIZER_BYTES,
    PARAM_BYTES,
    ModelShape,
    activation_bytes,
    recomputed_blocks,
)


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds: its training state between steps and its peak activations."""

    state: StateBytes
    activations: int


def held_groups(plan: ParallelPlan, per_group: dict[str, int], rank: int) -> list[str]:
    """The key groups rank ``rank`` holds (whole or as a shard)."""
    if plan.pipelines is not None:
        return sorted(g for g in plan.stage_groups(rank) if g in per_group)
    if plan.experts is not None:
        hosted = plan.experts.groups(rank)
        return sorted(g for g in per_group if not g.startswith("expert/") or g in hosted)
    return sorted(per_group)


def _fsdp_shards(plan: ParallelPlan, group: str) -> int:
    """Into how many shards FSDP2 cuts ``group``'s tensors under ``plan`` (1: whole).
    Expert parallelism without pipelines keeps the dense state replicated and hosted
    experts stay whole everywhere (``parallelize.apply_zero``)."""
    if not plan.zero.sharded or group.startswith("expert/"):
        return 1
    if plan.experts is not None and plan.pipelines is None:
        return 1
    return plan.zero.shard_size


def rank_state(
    plan: ParallelPlan, per_group: dict[str, int], rank: int, slots: int = 2
) -> StateBytes:
    """fp32 parameters, gradients and ``slots`` optimizer values per parameter that rank
    ``rank`` holds between steps (module docstring)."""
    held = 0
    for group in held_groups(plan, per_group, rank):
        held += -(-per_group[group] // _fsdp_shards(plan, group))
    return StateBytes(
        params=held * PARAM_BYTES,
        grads=held * GRAD_BYTES,
        optimizer=held * OPTIMIZER_BYTES * slots // 2,
    )


def _copied_params(
    plan: ParallelPlan, shape: ModelShape, per_group: dict[str, int], rank: int, unit: int
) -> int:
    """Parameters of ``unit`` autocast copies to bf16 on rank ``rank`` (outside FSDP2):
    of an MoE block under expert parallelism only the hosted experts."""
    params = shape.units[unit].params
    block = unit - 1
    if plan.experts is None or block not in shape.moe_blocks:
        return params
    local = rank % plan.processes_per_worker if plan.pipelines is not None else rank
    hosted = set(plan.experts.hosted(local).get(block, ()))
    absent = sum(
        per_group.get(expert_group(block, e), 0)
        for e in range(shape.num_experts)
        if e not in hosted
    )
    return params - absent


def _dispatch_bytes(
    plan: ParallelPlan, shape: ModelShape, per_group: dict[str, int], unit: int, precision: str
) -> float:
    """Per token, what expert parallelism keeps beyond a local dispatch: each of the
    token's top-k routed copies once more, as the all-to-all delivered it to its expert
    (in the wire dtype: the compute dtype)."""
    block = unit - 1
    if plan.experts is None or block not in shape.moe_blocks:
        return 0.0
    u = shape.units[unit]
    per_expert = per_group.get(expert_group(block, 0), 0)
    if not per_expert:
        return 0.0
    top_k = shape.num_experts - (u.params - u.active_params) // per_expert
    return top_k * shape.d_model * ACTIVATION_BYTES[precision]


def _pass_bytes(
    plan: ParallelPlan,
    shape: ModelShape,
    per_group: dict[str, int],
    rank: int,
    units: range,
    samples: int,
    precision: str,
    checkpointing: str,
) -> int:
    """Bytes ``units`` keep for backward over one pass of ``samples`` sequences."""
    recomputed = set(recomputed_blocks(shape.n_layers, checkpointing))
    tokens = samples * shape.seq_len
    total = 0
    for u in units:
        unit = shape.units[u]
        copied = _copied_params(plan, shape, per_group, rank, u)
        gathered = _fsdp_shards(plan, f"unit/{u}") > 1
        total += activation_bytes(
            shape, unit, tokens, precision, (u - 1) in recomputed, copied, gathered
        )
        if (u - 1) not in recomputed:
            total += int(tokens * _dispatch_bytes(plan, shape, per_group, u, precision))
    return total


def rank_activations(
    plan: ParallelPlan,
    shape: ModelShape,
    per_group: dict[str, int],
    rank: int,
    precision: str,
    checkpointing: str,
) -> int:
    """The most rank ``rank`` keeps for backward at once in a step (module docstring)."""
    layout = plan.pipelines
    if layout is None:
        share = plan.share(rank)[1]
        samples = min(plan.micro_batch_size, share)
        if samples == 0:
            return 0
        every = range(len(shape.units))
        return _pass_bytes(plan, shape, per_group, rank, every, samples, precision, checkpointing)
    stage = layout.stage(rank)
    if stage is None:
        return 0
    rows = [len(r) for r in layout.rows(stage.pipeline, rank)]
    passes = [
        _pass_bytes(plan, shape, per_group, rank, layout.units(rank), n, precision, checkpointing)
        for n in rows
    ]
    return max(_in_flight(layout.schedule, stage.stages, stage.index, passes), default=0)


def _in_flight(kind: str, stages: int, index: int, passes: list[int]) -> list[int]:
    """The bytes held after each pass of the stage's schedule: a forward adds its pass's
    activations, its backward frees them."""
    held, out = 0, []
    for op, i in schedule(kind, stages, index, len(passes)):
        held += passes[i] if op == "F" else -passes[i]
        out.append(held)
    return out


def rank_memory(
    plan: ParallelPlan,
    shape: ModelShape,
    per_group: dict[str, int],
    rank: int,
    precision: str,
    checkpointing: str,
) -> RankMemory:
    """The planner's prediction of what rank ``rank`` of ``plan`` holds."""
    return RankMemory(
        state=rank_state(plan, per_group, rank),
        activations=rank_activations(plan, shape, per_group, rank, precision, checkpointing),
    )
