"""Lazarus expert parallelism: replicated experts, quota dispatch, replica gradient sums.

Each rank hosts only the experts the generation's ``ExpertPlan`` gives it (each once; its
slots set its share of the expert's tokens). Dense parameters (embeddings, attention,
norms, routers) are replicated on every rank.

Forward of an MoE layer, per micro-batch, on every rank in lockstep: the layer's own
router (the family's ``MoELayer.route``), then its ``dispatch``, a ``QuotaDispatch``:
all-gather the per-expert counts -> the planner's quotas (the same on every rank,
a rank's own replica first) -> uneven all-to-all of the assignments -> each hosted expert
on its rows -> the reverse all-to-all -> combine with the router weights. Nothing is
dropped or padded. The all-to-alls are autograd functions, so each token's gradient goes
back to the rank that routed it. Under bf16 precision the tokens, the experts' outputs and
their gradients cross in bf16 (``QuotaDispatch.wire``).

After backward (``ExpertKeys.reduce_gradients``): the dense gradients are summed over
all ranks (each rank's loss is weighted by its share of the global batch), and each
expert's gradient is summed over the replicas that computed tokens in the step
(``QuotaDispatch.computed``; the quotas send an expert's tokens whole to one replica where
the load allows) and sent to all its hosts, in rank order, so every replica takes the same
step as the expert of a model trained without expert parallelism.

State: an expert's parameters and optimizer slots form the key group
``expert/<block>/<expert>`` (``layout``); a rank holds the dense keys and its experts'
groups. After a membership change the plan is settled onto what the ranks hold and the
missing experts come from surviving replicas through the engine's one transfer plan; an
expert with no surviving replica makes the adoption incomplete (checkpoint fallback).
Every ``rebalanceIntervalSteps`` the replica counts follow the measured loads (Eq. 1),
settled onto the current holders so the fewest experts move: the step returns that new
plan (``StepResult.next_plan``) and the runtime loop installs it (``Engine.install``,
``ExpertPlacement.install``), which moves the experts through the same transfer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from bulkhead.trainer.engine.clip import squared_norm
from bulkhead.trainer.engine.grad_sync import exchange_rounds, sum_over_holders
from bulkhead.trainer.engine.local_step import shardable
from bulkhead.trainer.engine.recompute import recomputing
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.transfers import execute_transfer
from bulkhead.trainer.engine.world import Team
from bulkhead.trainer.models.protocol import CausalLM, MoELayer, Routing
from bulkhead.trainer.parallel.dispatch import DispatchLayout
from bulkhead.trainer.parallel.experts_plan import (
    ExpertPlan,
    expert_group,
    held_matrix,
    plan_experts,
    settle,
)
from bulkhead.trainer.parallel.layout import Holding, KeySpec, needed_ranges
from bulkhead.trainer.parallel.plan import ParallelPlan
from bulkhead.trainer.parallel.transfer import plan_transfer

if TYPE_CHECKING:
    from bulkhead.trainer.engine.engine import Engine

log = logging.getLogger(__name__)

_LAYOUTS_KEPT = 8  # per MoE layer


@dataclass(frozen=True)
class Rebalance:
    """What one rebalance did (the same on every rank but ``bytes_received``)."""

    step: int  # completed steps when it ran
    loads: dict[int, tuple[int, ...]]  # block -> assignments per expert since the last one
    replicas: dict[int, tuple[int, ...]]  # block -> new replica counts
    copies: int  # expert states fetched by ranks that did not hold them
    bytes_received: int
    seconds: float

    def describe(self) -> str:
        counts = "; ".join(f"block {b}: {list(r)}" for b, r in self.replicas.items())
        return (
            f"step {self.step}: expert replicas follow the measured load ({counts}); "
            f"{self.copies} expert cop{'y' if self.copies == 1 else 'ies'} moved, "
            f"{self.bytes_received} bytes received here in {self.seconds:.3f}s"
        )


class QuotaDispatch:
    """An MoE layer's ``dispatch`` under expert parallelism: each routed assignment goes
    to a replica of its expert on some rank of ``team`` by the quotas, and comes back.

    The layer's own router, routing and auxiliary loss run unchanged (``MoELayer.forward``);
    only the path of the routed tokens to the experts differs from ``local_dispatch``.
    """

    def __init__(
        self,
        team: Team,
        num_experts: int,
        replicas: np.ndarray,
        slack: float,
        wire: torch.dtype | None = None,
    ) -> None:
        self.team = team  # the ranks the experts are spread over (ranks below: team ranks)
        self.slack = slack  # the plan's concentration slack
        # The dtype routed tokens travel in (bf16 under bf16 precision; None: as they are).
        self.wire = wire
        self.replicas = replicas  # (experts, team ranks): slots of each expert on each rank
        # Global assignments per expert since the last rebalance (the same on every rank).
        self.load = np.zeros(num_experts, dtype=np.int64)
        # (experts, team ranks): the replicas that computed tokens in training since the
        # gradients were last summed (the same on every rank); only theirs are summed.
        self.computed = np.zeros_like(replicas, dtype=bool)
        # Layouts of recent (counts, replicas): a recomputed block's second pass, and
        # micro-batches routed alike, reuse one instead of deriving the quotas again.
        self._layouts: dict[tuple[bytes, bytes], DispatchLayout] = {}

    def rehost(self, replicas: np.ndarray) -> None:
        """Dispatch over a new placement from the next step on."""
        self.replicas = replicas
        self.computed = np.zeros_like(replicas, dtype=bool)

    def layout(self, counts: np.ndarray) -> DispatchLayout:
        """The dispatch layout of these (ranks, experts) counts under the current replicas."""
        key = (counts.tobytes(), self.replicas.tobytes())
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) >= _LAYOUTS_KEPT:
                del self._layouts[next(iter(self._layouts))]  # the oldest
            found = self._layouts[key] = DispatchLayout.of(
                self.team.rank, counts, self.replicas, self.slack
            )
        return found

    def __call__(self, layer: MoELayer, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        top_k = routing.chosen.shape[-1]
        experts_of = routing.chosen.reshape(-1)
        local = torch.bincount(experts_of, minlength=layer.num_experts)
        counts = self.team.all_gather(local).cpu().numpy()  # (ranks, experts)
        if not recomputing():  # a checkpointed block's second pass routes the same tokens
            self.load += counts.sum(axis=0)
        layout = self.layout(counts)
        if layer.training:  # evaluation's passes leave no gradient
            self.computed |= layout.computing
        order = torch.from_numpy(layout.send_order(experts_of.cpu().numpy())).to(tokens.device)
        token_of = order // top_k  # assignment a is slot a % k of token a // k
        group = self.team.group
        sent = tokens[token_of]
        if self.wire is not None:
            sent = sent.to(self.wire)
        received = all_to_all_single_autograd(
            sent, layout.output_splits, layout.input_splits, group
        )
        # Derived from ``received`` even when no row is for an expert here, so that every
        # rank's backward runs both reverse all-to-alls (they are collective).
        outputs = received * 0.0
        for e, rows in layout.received_rows().items():
            index = torch.from_numpy(rows).to(tokens.device)
            out = layer.experts[str(e)](received[index])
            outputs = outputs.index_copy(0, index, out.to(outputs.dtype))
        returned = all_to_all_single_autograd(
            outputs, layout.input_splits, layout.output_splits, group
        )
        mixed = returned * routing.weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_of, mixed.to(tokens.dtype))


def host_experts(layer: MoELayer, hosted: tuple[int, ...], device: torch.device) -> None:
    """Keep the hosted experts that stay, add fresh ones (their state is transferred); the
    experts this rank does not host are freed."""
    kept = layer.experts
    layer.experts = nn.ModuleDict(
        {str(e): kept[str(e)] if str(e) in kept else layer.new_expert().to(device) for e in hosted}
    )


def distribute_experts(
    model: CausalLM,
    plan: ExpertPlan,
    team: Team,
    device: torch.device,
    blocks: range | None = None,
    wire: torch.dtype | None = None,
) -> dict[int, QuotaDispatch]:
    """Every MoE layer of the plan (in ``blocks``, if given) hosts this rank's experts and
    dispatches over ``team`` (tokens sent in ``wire``); returns the dispatchers by block."""
    layers = model.moe_layers()
    hosted = plan.hosted(team.rank)
    out = {}
    for placement in plan.layers:
        if blocks is not None and placement.layer not in blocks:
            continue
        layer = layers[placement.layer]
        host_experts(layer, hosted[placement.layer], device)
        dispatch = QuotaDispatch(
            team, layer.num_experts, placement.replica_matrix(), plan.concentration_slack, wire
        )
        layer.dispatch = dispatch
        out[placement.layer] = dispatch
    return out


def expert_groups(plan: ParallelPlan, rank: int) -> frozenset[str]:
    """The key groups of the experts rank ``rank`` hosts."""
    return _experts_of(plan).groups(rank)


def all_expert_groups(plan: ParallelPlan) -> list[str]:
    """Every expert's key group, by block then expert."""
    ep = _experts_of(plan)
    return [expert_group(p.layer, e) for p in ep.layers for e in range(ep.num_experts)]


def _experts_of(plan: ParallelPlan) -> ExpertPlan:
    assert plan.experts is not None
    return plan.experts


class ExpertKeys:
    """Whole keys (nothing is sharded), each expert's in its group; the dense gradients
    summed over all ranks, each expert's over its hosts."""

    def __init__(self) -> None:
        self._rounds: dict[tuple[int, int, str], int] | None = None

    def shardable(self, engine: Engine, key: str, t: torch.Tensor) -> bool:
        return shardable(key, t)

    def layout(
        self, engine: Engine, entries: list[tuple[KeySpec, torch.Tensor]]
    ) -> tuple[list[tuple[KeySpec, torch.Tensor]], list[KeySpec]]:
        """This rank's keys, each expert's in its group, and every expert's keys, hosted
        here or not (all experts have one shape)."""
        keys = engine.keygroups
        plan = _experts_of(engine.plan)
        grouped = []
        for spec, t in entries:
            where = keys.expert_of(spec.name)
            group = expert_group(*where) if where else ""
            grouped.append((replace(spec, shardable=False, group=group), t))
        template = [s for s, _ in grouped if s.group]
        first = keys.expert_of(template[0].name) if template else None
        one_expert = [s for s in template if keys.expert_of(s.name) == first]
        everything = {s.name: s for s, _ in grouped if not s.group}
        for p in plan.layers:
            for e in range(plan.num_experts):
                for s in one_expert:
                    name = keys.renumber(s.name, p.layer, e)
                    everything[name] = replace(s, name=name, group=expert_group(p.layer, e))
        return grouped, [everything[name] for name in sorted(everything)]

    def reduce_gradients(self, engine: Engine, params: list[torch.Tensor]) -> float:
        """Dense gradients summed over all ranks, each expert's over its hosts; returns
        this rank's share of the squared global norm (each gradient counted once)."""
        world, plan = engine.world, _experts_of(engine.plan)
        names = {id(p): name for name, p in engine.model.named_parameters()}
        grads = {names[id(p)]: p.grad for p in params}
        keys = engine.keygroups
        dense = [g for name, g in grads.items() if keys.expert_of(name) is None]
        flat = torch.cat([g.reshape(-1) for g in dense])
        world.all_reduce(flat)
        offset = 0
        for g in dense:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        norm_sq = squared_norm([flat]) if world.rank == 0 else 0.0
        # Each hosted expert's gradients, keyed (block, expert, name): summed in place over
        # the expert's hosts, one copy into the exchange's buffer (a flat tensor per expert,
        # copied back after the sum, was two more copies of every expert gradient).
        hosts = {(p.layer, e): p.hosts(e) for p in plan.layers for e in range(plan.num_experts)}
        mine: dict[tuple[int, int, str], torch.Tensor] = {}
        for name, g in grads.items():
            where = keys.expert_of(name)
            if where is not None:
                mine[(*where, name)] = g
        if self._rounds is None:  # every expert of the model: fixed for the engine's life
            self._rounds = _expert_rounds(engine)
        computed = _computed_by(engine)  # hosts only: ``rehost`` starts the record over
        # Chunked sums pay a second all-to-all: only when some expert (of any rank) was
        # computed by two or more of three or more hosts.
        chunked = any(len(computed[w]) >= 2 and len(hosts[w]) >= 3 for w in computed)
        norm_sq += sum_over_holders(
            world,
            mine,
            {k: hosts[k[:2]] for k in mine},
            self._rounds,
            {k: computed[k[:2]] for k in mine},
            chunked,
        )
        return norm_sq

    def overwritten(self, engine: Engine, params: list[torch.Tensor]) -> set[int]:
        """The replicas here that computed no token: not sources, so their sum overwrites
        them (zeros for these were 3 % of a d-512 step). The record may hold more than this
        step (a step that failed after its forward): a replica it counts still gets zeros."""
        names = {id(p): name for name, p in engine.model.named_parameters()}
        dispatches = engine.model_layout.dispatches
        out = set()
        for p in params:
            where = engine.keygroups.expert_of(names[id(p)])
            if where is not None:
                dispatch = dispatches[where[0]]
                if not dispatch.computed[where[1], dispatch.team.rank]:
                    out.add(id(p))
        return out


def _computed_by(engine: Engine) -> dict[tuple[int, int], tuple[int, ...]]:
    """(block, expert) -> the ranks whose replica computed tokens since the last sum (a
    hosted expert absent from it has a zero gradient); starts them over."""
    out = {}
    for block, dispatch in engine.model_layout.dispatches.items():
        for e, row in enumerate(dispatch.computed):
            out[(block, e)] = tuple(int(r) for r in np.flatnonzero(row))
        dispatch.computed[:] = False
    return out


def _expert_rounds(engine: Engine) -> dict[tuple[int, int, str], int]:
    """Every expert parameter's round of the gradient exchange (``exchange_rounds``): the
    experts of one layer in sequence, so a round carries at most a budget's worth of each
    layer's experts, whichever a rank hosts."""
    keys = engine.keygroups
    numels, teams = {}, {}
    for spec in engine.specs:
        name = spec.name.removeprefix("param/")
        where = keys.expert_of(name) if spec.name.startswith("param/") else None
        if where is not None:
            numels[(*where, name)] = spec.numel
            teams[(*where, name)] = where[0]
    return exchange_rounds(numels, teams)


class ExpertPlacement:
    """The placement part of an expert layout: settled onto what the ranks hold when a
    generation adopts its state, rebalanced to the measured loads every
    ``rebalanceIntervalSteps`` by a new plan the caller installs."""

    def __init__(self, dispatches: dict[int, QuotaDispatch]) -> None:
        self.dispatches = dispatches  # block -> its layer's QuotaDispatch
        self._have: np.ndarray | None = None  # held_matrix of the last holdings exchange
        self._settled = False
        self.interrupted: HeldState | None = None  # state kept when a migration failed

    # -- adoption ----------------------------------------------------------------------

    def observe(self, plan: ParallelPlan, holdings: list[Holding]) -> None:
        """Note which experts every rank holds (from the adoption's exchange)."""
        self._have = held_matrix(_experts_of(plan), [h.groups or frozenset() for h in holdings])

    def settle_once(self, engine: Engine) -> None:
        """Lay the plan onto the experts the ranks hold, so the fewest move (once per
        generation: later adoptions keep the placement)."""
        if not self._settled:
            assert self._have is not None, "settling needs the holdings exchange first"
            self._rehost(engine, settle(_experts_of(engine.plan), self._have))
            self._settled = True

    def _rehost(self, engine: Engine, plan: ExpertPlan) -> None:
        """Host ``plan``'s experts; the engine relays its state keys out (their state
        comes by transfer)."""
        if plan == engine.plan.experts:
            return
        hosted = plan.hosted(engine.world.rank)
        layers = engine.model.moe_layers()
        for p in plan.layers:
            host_experts(layers[p.layer], hosted[p.layer], engine.world.device.device)
            self.dispatches[p.layer].rehost(p.replica_matrix())
        engine.take_plan(replace(engine.plan, experts=plan), rehosted=True)

    # -- rebalancing -------------------------------------------------------------------

    def next_plan(self, engine: Engine) -> ParallelPlan | None:
        """After a committed step: the rebalanced plan when one is due."""
        interval = _experts_of(engine.plan).rebalance_interval_steps
        if interval and engine.completed_steps % interval == 0:
            return self.rebalanced_plan(engine)
        return None

    def rebalanced_plan(self, engine: Engine) -> ParallelPlan | None:
        """The plan whose replica counts follow the loads measured since the last
        rebalance, settled onto the current hosts so the fewest experts move (the same on
        every rank: the loads are global); None when nothing was measured. The loads
        start over; ``install`` moves the replicas."""
        plan = _experts_of(engine.plan)
        blocks = self.dispatches
        loads = {layer: blocks[layer].load.tolist() for layer in blocks}
        for dispatch in blocks.values():
            dispatch.load[:] = 0
        if not any(sum(v) for v in loads.values()):
            return None
        ep = engine.cfg.parallelism.experts
        fresh = plan_experts(
            plan.ranks,
            plan.num_experts,
            [p.layer for p in plan.layers],
            plan.min_replicas,
            ep.slots_per_worker if ep else plan.slots_per_rank,
            plan.rebalance_interval_steps,
            loads,
            plan.concentration_slack,
        )
        held = [plan.groups(r) for r in range(plan.ranks)]
        return replace(engine.plan, experts=settle(fresh, held_matrix(fresh, held)))

    def install(self, engine: Engine, plan: ParallelPlan) -> Rebalance | None:
        """Run ``plan`` (a ``rebalanced_plan``) from the next step on: host its experts
        and fetch the states this rank lacks from their holders (collective, at a step
        boundary); returns what moved, None when the placement stays."""
        if replace(plan, experts=engine.plan.experts) != engine.plan or plan.experts is None:
            raise ValueError(f"generation {plan.generation}: only the expert placement may change")
        started = time.perf_counter()
        current, target = _experts_of(engine.plan), plan.experts
        if [p.slots for p in target.layers] == [p.slots for p in current.layers]:
            engine.take_plan(plan, rehosted=False)  # same placement, new loads
            return None
        held = [current.groups(r) for r in range(current.ranks)]
        old = engine.held_state()
        try:
            received = self._migrate(engine, target, old, held)
        except BaseException:
            # A peer failed mid-migration: the state of the committed step is the old one.
            self.interrupted = old
            raise
        done = Rebalance(
            step=engine.completed_steps,
            loads={p.layer: p.loads for p in target.layers},
            replicas={p.layer: p.replicas for p in target.layers},
            copies=sum(len(target.groups(r) - held[r]) for r in range(current.ranks)),
            bytes_received=received,
            seconds=time.perf_counter() - started,
        )
        log.info("%s", done.describe())
        return done

    def _migrate(
        self, engine: Engine, target: ExpertPlan, old: HeldState, held: list[frozenset[str]]
    ) -> int:
        """Host ``target`` and fetch what this rank lacks; returns the bytes received."""
        ranks = target.ranks
        step = engine.completed_steps
        holdings = [Holding(step, ranks, r, groups=held[r]) for r in range(ranks)]
        self._rehost(engine, target)
        needs = [needed_ranges(1, 0, engine.specs, target.groups(r)) for r in range(ranks)]
        transfer = plan_transfer(holdings, needs, engine.specs)
        assert transfer.complete, "every expert is held by some rank at a step boundary"
        return execute_transfer(
            transfer,
            engine.world,
            old,
            engine.local_tensors(),
            needs[engine.world.rank],
            {s.name: s for s in engine.specs},
        )
