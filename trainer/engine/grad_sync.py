"""The step-boundary agreement: one small all-reduce that commits a step on every rank.

Gradients are reduced before it, overlapped with the backward pass (DDP buckets for a
replicated layout, FSDP2's reduce-scatters for a sharded one). The agreement carries the
summed language-model and balance losses, the flag "a rank saw a newer generation or is
leaving" (so all ranks switch after the same step; a rank told to stop leaves on its own
and the others go on to the next generation), each rank's share of the squared gradient
norm (for clipping sharded gradients: only one replica group contributes, since the
replicas hold identical shards), and each rank's compute time in its own slot (straggler
detection without another collective).

Layouts where ranks hold different keys (pipeline stages, expert replicas) reduce their
gradients before it with ``sum_over_holders``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from bulkhead.trainer.engine.clip import squared_norm
from bulkhead.trainer.engine.world import World

_HEADER = 4  # lm_sum, aux_sum, newer, grad_norm_sq
# Elements of gradient per team and round of ``sum_over_holders`` (4 MiB in fp32): the
# exchange's buffers hold about that per team a rank holds; a decoder block of a 70B model
# (~0.9 x 10^9 parameters) takes ~850 rounds, about DDP's bucket count at that size.
EXCHANGE_BUDGET = 1 << 20


@dataclass(frozen=True)
class Agreement:
    lm_sum: float
    aux_sum: float
    newer_generation: bool
    grad_norm_sq: float
    compute_s: list[float]


def reduce_step(
    world: World,
    lm_sum: float,
    aux_sum: float,
    newer_generation: bool,
    grad_norm_sq: float,
    compute_s: float,
) -> Agreement:
    """Sum the step's header and compute times across the world (polled, abandonable)."""
    device = world.device.device  # NCCL reduces device tensors, gloo host ones
    compute = torch.zeros(world.world_size, dtype=torch.float32, device=device)
    compute[world.rank] = compute_s
    header = torch.tensor(
        [lm_sum, aux_sum, float(newer_generation), grad_norm_sq],
        dtype=torch.float32,
        device=device,
    )
    flat = torch.cat([header, compute])
    world.all_reduce(flat)
    lm, aux, newer, norm_sq = flat[:_HEADER].tolist()
    return Agreement(
        lm_sum=lm,
        aux_sum=aux,
        newer_generation=newer > 0,
        grad_norm_sq=norm_sq,
        compute_s=flat[_HEADER:].tolist(),
    )


def exchange_rounds(
    numels: dict[Any, int], teams: dict[Any, Hashable], budget: int = EXCHANGE_BUDGET
) -> dict[Any, int]:
    """Key -> the round of ``sum_over_holders`` that carries it. Within each team (keys
    held by the same ranks, e.g. a pipeline unit's), in sorted key order, a new round each
    time ``budget`` elements are reached, so a rank's keys spread over as few rounds as
    its teams need. ``numels`` and ``teams`` must be the same on every rank (every key of
    the model, held here or not): every rank then runs as many rounds (the largest team's)
    and each key's holders put it in the same one."""
    rounds: dict[Any, int] = {}
    filled: dict[Hashable, tuple[int, int]] = {}  # team -> (round, elements in it)
    for key in sorted(numels):
        round_, count = filled.get(teams[key], (0, 0))
        if count and count + numels[key] > budget:
            round_, count = round_ + 1, 0
        rounds[key] = round_
        filled[teams[key]] = (round_, count + numels[key])
    return rounds


def sum_over_holders(
    world: World,
    grads: dict[Any, torch.Tensor],
    holders: dict[Any, tuple[int, ...]],
    rounds: dict[Any, int] | None = None,
    sources: dict[Any, tuple[int, ...]] | None = None,
    chunked: bool = False,
) -> float:
    """Each gradient summed in place over the ranks holding it (layouts where ranks hold
    different keys: pipeline stages, expert replicas); returns this rank's share of the
    squared global norm (each gradient counted by its first holder).

    ``holders[key]``: ascending ranks, this one among them. An uneven all-to-all carries,
    to each peer, every gradient both hold, in key order; the sum runs in rank order, so
    every holder computes the same bits and takes the same step. Sums are written in
    place and the norm is one fused call with one host sync.

    ``sources[key]`` (ascending, a subset of the holders; default: all of them): the
    holders whose gradient can be non-zero (an expert replica that computed no token
    has none). Only they send, and every holder's gradient becomes their sum: an expert
    computed by one replica costs one copy to each other host, not one from every host
    to every other. ``chunked`` (the same on every rank): the keys with two or more
    sources and three or more holders are summed in chunks, which costs a second
    all-to-all per round (``_exchange_and_sum``).

    ``rounds`` (``exchange_rounds``, every key of the model): one all-to-all per round,
    each carrying its keys, so the exchange's send and receive buffers hold one round's
    gradients, not all of them (a d-512 pipeline stage's whole gradients were two extra
    copies at the peak, where the baseline's all-reduce needs one). Without it, one round.
    """
    keys = sorted(grads)
    count = 1 + max(rounds.values(), default=0) if rounds else 1
    by_round: list[list[Any]] = [[] for _ in range(count)]
    for key in keys:
        by_round[rounds[key] if rounds else 0].append(key)
    counted: list[torch.Tensor] = []
    for round_keys in by_round:  # every rank runs every round, also with nothing in it
        counted += _exchange_and_sum(world, grads, holders, sources or holders, round_keys, chunked)
    return squared_norm(counted)


def _exchange_and_sum(
    world: World, grads: dict[Any, torch.Tensor], holders: dict[Any, tuple[int, ...]],
    sources: dict[Any, tuple[int, ...]], keys: list[Any], chunked: bool,
) -> list[torch.Tensor]:  # fmt: skip
    """One round of ``sum_over_holders``: the gradients this rank counts in the norm.

    The first all-to-all carries each *direct* key's gradient from every source to every
    other holder, which then sums them; and, if ``chunked``, each *scattered* key's (at
    least two sources and three holders) chunk i from every source to its i-th source,
    which sums that chunk alone. A second all-to-all then carries the scattered keys'
    summed chunks to the other holders: per key, (sources - 1) + (holders - 1) gradient
    sizes cross the wire where sending it whole would cost sources x (holders - 1) (an
    expert on 4 hosts: 6 against 12), and each source adds one chunk, not the whole
    gradient."""
    me = world.rank
    scattered = {k for k in keys if chunked and len(sources[k]) >= 2 and len(holders[k]) >= 3}
    first: dict[int, list[torch.Tensor]] = {}
    first_sizes = [0] * world.world_size
    for key in keys:
        g, src = grads[key], sources[key]
        if key in scattered:
            if me in src:
                cuts = _chunks(g.numel(), len(src))
                for i, owner in enumerate(src):
                    if owner != me:
                        first.setdefault(owner, []).append(g.view(-1)[cuts[i] : cuts[i + 1]])
                mine = src.index(me)
                for peer in src:
                    if peer != me:
                        first_sizes[peer] += cuts[mine + 1] - cuts[mine]
            continue
        if me in src:
            for peer in holders[key]:
                if peer != me:
                    first.setdefault(peer, []).append(g.reshape(-1))
        for peer in src:
            if peer != me:
                first_sizes[peer] += g.numel()
    received = _all_to_all(world, grads, first, first_sizes)
    cursor = dict.fromkeys(received, 0)
    counted = [grads[key] for key in keys if holders[key][0] == me]

    def take(peer: int, numel: int) -> torch.Tensor:
        piece = received[peer][cursor[peer] : cursor[peer] + numel]
        cursor[peer] += numel
        return piece

    second: dict[int, list[torch.Tensor]] = {}
    second_sizes = [0] * world.world_size
    for key in keys:
        g, src = grads[key], sources[key]
        if key in scattered:
            cuts = _chunks(g.numel(), len(src))
            if me in src:  # sum this rank's chunk in rank order, send it to the others
                i = src.index(me)
                own = g.view(-1)[cuts[i] : cuts[i + 1]]
                pieces = [own if p == me else take(p, own.numel()) for p in src]
                _sum_in_order_(own, pieces)
                for peer in holders[key]:
                    if peer != me:
                        second.setdefault(peer, []).append(own)
            for i, owner in enumerate(src):
                if owner != me:
                    second_sizes[owner] += cuts[i + 1] - cuts[i]
            continue
        pieces = [g if p == me else take(p, g.numel()).view_as(g) for p in src]
        if len(pieces) > 1 or (pieces and pieces[0] is not g):
            _sum_in_order_(g, pieces)
        elif not pieces:  # no holder computed it: every holder's gradient is zero
            g.zero_()
    if not chunked:
        return counted
    received = _all_to_all(world, grads, second, second_sizes)
    cursor = dict.fromkeys(received, 0)
    for key in keys:
        if key in scattered:
            g, src = grads[key], sources[key]
            cuts = _chunks(g.numel(), len(src))
            for i, owner in enumerate(src):
                if owner != me:
                    g.view(-1)[cuts[i] : cuts[i + 1]].copy_(take(owner, cuts[i + 1] - cuts[i]))
    return counted


def _chunks(numel: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` near-equal chunks of ``numel`` elements."""
    return [i * numel // parts for i in range(parts + 1)]


def _all_to_all(
    world: World,
    grads: dict[Any, torch.Tensor],
    sends: dict[int, list[torch.Tensor]],
    recv_sizes: list[int],
) -> dict[int, torch.Tensor]:
    """One uneven all-to-all (collective: every rank calls it, also with nothing to move)
    of the ``sends`` to each peer, concatenated in rank order; returns what each peer sent
    here."""
    peers = range(world.world_size)
    some = next(iter(grads.values()), None)
    dtype = some.dtype if some is not None else torch.float32
    device = world.device.device
    send_sizes = [sum(t.numel() for t in sends.get(p, ())) for p in peers]
    # One copy of the gradients, straight into the send buffer in rank order (a buffer
    # per peer, concatenated, was a second copy: 1-2 % of a pipeline step on a CPU).
    parts = [t for p in peers for t in sends.get(p, ())]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    sends.clear()
    del parts
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    world.all_to_all(out, flat, recv_sizes, send_sizes)
    del flat
    pieces = out.split(recv_sizes)
    return {p: pieces[p] for p in peers if recv_sizes[p]}


def _sum_in_order_(own: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """``own`` becomes the sum of ``pieces`` (``own`` among them, or not: a holder that
    computed nothing), added in list order: the same bits on every holder. In place when
    that keeps the order (``own`` first, or two pieces: a + b and b + a are the same bits),
    else through one new tensor."""
    if any(piece is own for piece in pieces) and (pieces[0] is own or len(pieces) == 2):
        for piece in pieces:
            if piece is not own:
                own.add_(piece)
        return
    if len(pieces) == 1:
        own.copy_(pieces[0])
        return
    total = pieces[0] + pieces[1]
    for piece in pieces[2:]:
        total += piece
    own.copy_(total)
