"""How a new generation's engine takes the newest state any rank holds: ``adopt``.

Every rank of the generation calls ``adopt(engine, held)`` with what its process holds
(its previous engine's state, pieces restored from a checkpoint, or None for a new
member). In order:

1. *Roll forward* (``roll_forward``): a step some ranks committed and this one did not
   (its agreement all-reduce failed here after reaching others) is completed with the
   gradient norm a committed rank applied, so every survivor is at the same step again
   without any state copy.
2. *Exchange* what every rank holds (the engine's holdings policy, ``holdings``).
3. If nobody holds anything: a *fresh start* (the seeded initialization, or the
   pretrained weights the spec names, each rank reading only its own ranges).
4. Otherwise one *transfer plan* from the holders to what each rank needs under this
   plan (``parallel.transfer.plan_transfer``), executed over the world
   (``transfers.execute_transfer``). Some key with no holder leaves the state unchanged
   and returns an incomplete ``Adoption``: the caller falls back to the checkpoint.

The engine is read through a few attributes (its plan, world, config, model, holdings
policy, expert placement, state keys and ``local_tensors``) and written in three
(``completed_steps``, ``adopted``, ``initialized``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from bulkhead.trainer.engine.pretrained import hf_reader, initial_state_from_pretrained
from bulkhead.trainer.engine.state import Adoption, HeldState
from bulkhead.trainer.engine.transfers import execute_transfer
from bulkhead.trainer.engine.world import World
from bulkhead.trainer.models.protocol import build_seeded
from bulkhead.trainer.parallel.layout import NOTHING, Holding, Range
from bulkhead.trainer.parallel.transfer import plan_transfer

if TYPE_CHECKING:  # it imports this module
    from bulkhead.trainer.engine.engine import Engine

log = logging.getLogger(__name__)


def adopt(engine: Engine, held: HeldState | None) -> Adoption:
    """Give ``engine`` the newest state any rank holds (collective: every rank calls it).

    Returns an incomplete ``Adoption`` when some key has no holder; the engine's state is
    then unchanged.
    """
    started = time.perf_counter()
    held = roll_forward(engine.world, held)
    holdings = engine.holdings.exchange(engine.world, engine.plan, held, engine.specs)
    if engine.experts is not None:
        engine.experts.observe(engine.plan, holdings)
    if all(h.empty for h in holdings):
        if engine.cfg.pretrained is not None:
            _load_pretrained(engine, engine.cfg.pretrained)
        elif not engine.initialized:
            _initialize(engine)
        engine.completed_steps = 0
        engine.adopted = True
        return Adoption(0, "fresh", 0, time.perf_counter() - started, {})
    needs = _needs(engine, holdings)
    source = engine.holdings.source(held, engine.specs)
    transfer = plan_transfer(holdings, needs, engine.specs)
    if not transfer.complete:
        return Adoption(
            transfer.step, "incomplete", 0, time.perf_counter() - started, transfer.missing
        )
    received = execute_transfer(
        transfer,
        engine.world,
        source,
        engine.local_tensors(),
        needs[engine.world.rank],
        {s.name: s for s in engine.specs},
    )
    engine.completed_steps = transfer.step
    engine.adopted = True
    only_local = all(m.src == m.dst for m in transfer.moves)
    return Adoption(
        transfer.step,
        "kept" if only_local else "peers",
        received,
        time.perf_counter() - started,
        {},
    )


def roll_forward(world: World, held: HeldState | None) -> HeldState | None:
    """Complete a step some ranks committed and this one did not (collective).

    Every rank shares its step, whether it has one pending, and the gradient norm its
    last committed step applied. A rank with step s pending completes it when some rank
    is at s + 1: its gradients were fully reduced (no rank can commit before every rank
    has), so the update with the same norm is the one the others applied. When no rank
    committed, the pending step is dropped and redone by everyone. ``held``'s commit
    record is consumed.
    """
    record = held.commit if held is not None else None
    step = held.holding.step if held is not None else -1
    pending = record is not None and record.finish is not None
    norm = record.norm_sq if record is not None and record.norm_sq is not None else math.nan
    row = torch.tensor([step, float(pending), norm], dtype=torch.float64)
    rows = world.all_gather(row.to(world.device.device)).cpu().tolist()
    if held is None:
        return None
    held.commit = None  # used once: let the previous engine (its gradients) go
    if not pending:
        return held
    assert record is not None and record.finish is not None
    ahead = [r for r in rows if r[0] == step + 1 and not math.isnan(r[2])]
    if not ahead:
        return HeldState(held.holding, held.tensors)
    record.finish(ahead[0][2])
    log.info(
        "step %d: committed by %d rank(s) but not here; completed it with their gradient norm",
        step,
        len(ahead),
    )
    return HeldState(replace(held.holding, step=step + 1), held.tensors)


def _needs(engine: Engine, holdings: list[Holding]) -> list[dict[str, Range]]:
    """What each rank must hold under the engine's plan."""
    if engine.experts is not None:  # the placement settled onto what the ranks hold
        engine.experts.settle_once(engine)
    return engine.holdings.needs(engine.plan, engine.specs, len(holdings))


def _fresh_ranges(engine: Engine) -> dict[str, Range]:
    """This rank's ranges of a fresh start (nobody holds anything)."""
    return _needs(engine, [NOTHING] * engine.world.world_size)[engine.world.rank]


def _initialize(engine: Engine) -> None:
    """The seeded initial parameters, each rank its own ranges (a fresh start of an
    engine built without them)."""
    cfg = engine.cfg
    seeded = build_seeded(cfg.family, cfg.model, cfg.seed).named_parameters()
    whole = {f"param/{name}": p.detach().reshape(-1) for name, p in seeded}
    wanted = _fresh_ranges(engine)
    local = engine.local_tensors()
    for key, (start, stop) in wanted.items():
        if key in whole and key in local:
            local[key].copy_(whole[key][start:stop])
    engine.initialized = True


@torch.no_grad()
def _load_pretrained(engine: Engine, directory: str) -> None:
    """A fresh start from ``directory``'s weights: each rank reads its own ranges."""
    wanted = _fresh_ranges(engine)
    local = engine.local_tensors()
    read = engine.read_pretrained or hf_reader()
    tensors = initial_state_from_pretrained(
        directory,
        engine.model,
        {k: r for k, r in wanted.items() if k in local},
        {s.name: s for s in engine.specs},
        read,
        into=local,
    )
    for key, flat in tensors.items():
        if flat.data_ptr() != local[key].data_ptr():  # read elsewhere (another device)
            local[key].copy_(flat)
    engine.initialized = True
    log.info("fresh start from the pretrained weights in %s", directory)
