"""What ``bulkhead plan --fail K`` shows at cluster scale: the plan after losing nodes, and
which rank sends which layer shard (Oobleck's reconfiguration). The engine's own
re-formation is ``trainer/parallel/pipeline_plan.py``'s ``unit_fetches``.

Steps: (1) the fastest instantiation for the survivors (``choose_pipelines``; a clear
PlanError below (f+1) n0 nodes); (2) survivors are matched to the new pipelines so that
data stays put: a surviving pipeline whose node count is still wanted is KEPT whole (no
transfer if its template is unchanged), then the largest remnants fill the remaining
pipelines (RESHAPED when from one old pipeline, MERGED when from several, Oobleck's
borrow/merge), and inside each pipeline every node takes the position where it already
holds most of the layer shards asked for (greedy, ties keep the old order); (3) every rank
that now owns a layer shard it did not hold before fetches it from a surviving holder: on
its own node when possible (no network), else from the holder pipeline with the fewest
bytes assigned so far, spreading the load.

A shard is (layer, shard index, shard count) with FSDP inside a stage; parameters and
optimizer state move together (gradients are recomputed). Ranks are the new generation's:
node position among the survivors * GPUs per node + local GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from bulkhead.trainer.planning.costs import LayerCost
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.instantiate import (
    Instantiation,
    PipelinePlan,
    choose_pipelines,
    split_batch,
    stage_ranks,
)
from bulkhead.trainer.planning.templates import PipelineTemplate, TemplateSet

Fate = Literal["kept", "reshaped", "merged"]


@dataclass(frozen=True)
class LayerTransfer:
    """Rank ``src`` sends to rank ``dst`` the part of ``layer`` where its old shard
    ``src_shard``/``src_shards`` overlaps the new shard ``shard``/``shards``."""

    layer: int
    shard: int
    shards: int
    src_shard: int
    src_shards: int
    src: int
    dst: int
    nbytes: int
    network: bool  # False when both ranks are on the same node

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "shard": self.shard,
            "shards": self.shards,
            "srcShard": self.src_shard,
            "srcShards": self.src_shards,
            "src": self.src,
            "dst": self.dst,
            "bytes": self.nbytes,
            "network": self.network,
        }


@dataclass(frozen=True)
class ReconfigurationPlan:
    lost_nodes: tuple[str, ...]
    plan: Instantiation
    fates: tuple[Fate, ...]  # per new pipeline
    transfers: tuple[LayerTransfer, ...]
    missing_layers: tuple[int, ...]  # no survivor holds them: restore from a checkpoint

    @property
    def network_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.network)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lostNodes": list(self.lost_nodes),
            "fates": list(self.fates),
            "plan": self.plan.to_dict(),
            "transfers": [t.to_dict() for t in self.transfers],
            "networkBytes": self.network_bytes,
            "missingLayers": list(self.missing_layers),
        }


def _assign_nodes(
    old: Instantiation, lost: set[str], wanted: list[PipelineTemplate]
) -> list[tuple[PipelineTemplate, list[str], Fate]]:
    groups = [[n for n in p.nodes if n not in lost] for p in old.pipelines]
    sizes = [p.template.num_nodes for p in old.pipelines]
    out: list[tuple[PipelineTemplate, list[str], Fate]] = []
    open_ = list(wanted)
    # Whole survivors first; untouched pipelines (same size as before) before shrunk ones.
    for untouched in (True, False):
        for template in list(open_):
            match = next(
                (
                    i
                    for i, g in enumerate(groups)
                    if g and len(g) == template.num_nodes and (len(g) == sizes[i]) == untouched
                ),
                None,
            )
            if match is not None:
                kept = untouched and old.pipelines[match].template == template
                out.append((template, groups[match], "kept" if kept else "reshaped"))
                groups[match] = []
                open_.remove(template)
    for template in open_:
        nodes: list[str] = []
        sources = 0
        while len(nodes) < template.num_nodes:
            i = max(range(len(groups)), key=lambda i: len(groups[i]))
            take = groups[i][: template.num_nodes - len(nodes)]
            groups[i] = groups[i][len(take) :]
            nodes += take
            sources += 1
        out.append((template, nodes, "merged" if sources > 1 else "reshaped"))
    return out


def _holdings(plan: Instantiation) -> dict[tuple[str, int], set[tuple[int, int, int]]]:
    """(node, local GPU) -> {(layer, shard, shards)} held under ``plan``."""
    held: dict[tuple[str, int], set[tuple[int, int, int]]] = {}
    for pipe in plan.pipelines:
        for stage in pipe.template.stages:
            node = pipe.nodes[stage.node]
            for i in range(stage.gpus):
                gpu = stage.gpu_offset + i
                bucket = held.setdefault((node, gpu), set())
                bucket.update(
                    (lay, i, stage.gpus) for lay in range(stage.layer_start, stage.layer_end)
                )
    return held


def _order_nodes(
    template: PipelineTemplate,
    nodes: list[str],
    held: dict[tuple[str, int], set[tuple[int, int, int]]],
    layers: Sequence[LayerCost],
) -> list[str]:
    """Put each node where it already holds most of the shards the template asks for.

    Greedy over (position, node) pairs by kept bytes, best first; ties keep the old order.
    """
    index = {name: x for x, name in enumerate(nodes)}
    # (layer, local GPU, shard, shards) -> the template position that wants it there.
    wanted: dict[tuple[int, int, int, int], int] = {}
    for stage in template.stages:
        for i in range(stage.gpus):
            for lay in range(stage.layer_start, stage.layer_end):
                wanted[(lay, stage.gpu_offset + i, i, stage.gpus)] = stage.node
    keep = np.zeros((template.num_nodes, len(nodes)), dtype=np.int64)
    for (name, gpu), shards in held.items():
        if name not in index:
            continue
        for lay, i, d in shards:
            pos = wanted.get((lay, gpu, i, d))
            if pos is not None:
                keep[pos, index[name]] += (
                    layers[lay].param_bytes + layers[lay].optimizer_bytes
                ) // d
    order: list[str | None] = [None] * template.num_nodes
    used = np.zeros(len(nodes), dtype=bool)
    for flat in np.argsort(-keep, axis=None, kind="stable"):
        pos, x = divmod(int(flat), len(nodes))
        if order[pos] is None and not used[x]:
            order[pos], used[x] = nodes[x], True
    return [n for n in order if n is not None]


def reconfigure(
    old: Instantiation,
    templates: TemplateSet,
    lost_nodes: Sequence[str],
    layers: Sequence[LayerCost],
) -> ReconfigurationPlan:
    """The new plan for the survivors of ``old`` and the layer shards that must move."""
    lost = set(lost_nodes)
    unknown = lost - set(old.nodes)
    if unknown:
        raise PlanError(f"lost nodes {sorted(unknown)} are not in the current plan")
    survivors = [n for n in old.nodes if n not in lost]
    g = templates.gpus_per_node
    wanted = choose_pipelines(
        templates, len(survivors), old.fault_tolerance, old.global_microbatches
    )
    held = _holdings(old)
    assigned = [
        (t, _order_nodes(t, nodes, held, layers), fate)
        for t, nodes, fate in _assign_nodes(old, lost, wanted)
    ]
    counts = split_batch([t for t, _, _ in assigned], old.global_microbatches)
    position = {name: i for i, name in enumerate(survivors)}
    pipelines = tuple(
        PipelinePlan(t, tuple(nodes), stage_ranks(t, nodes, position, templates), c)
        for (t, nodes, _), c in zip(assigned, counts, strict=True)
    )
    new = Instantiation(
        pipelines=pipelines,
        gpus_per_node=g,
        fault_tolerance=old.fault_tolerance,
        global_microbatches=old.global_microbatches,
        iteration_time_ns=max(p.time_ns for p in pipelines),
    )
    transfers, missing = _transfers(old, new, lost, position, layers)
    return ReconfigurationPlan(
        lost_nodes=tuple(sorted(lost)),
        plan=new,
        fates=tuple(f for _, _, f in assigned),
        transfers=tuple(transfers),
        missing_layers=tuple(missing),
    )


def _transfers(
    old: Instantiation,
    new: Instantiation,
    lost: set[str],
    position: dict[str, int],
    layers: Sequence[LayerCost],
) -> tuple[list[LayerTransfer], list[int]]:
    g = new.gpus_per_node
    held = _holdings(old)
    # layer -> surviving holders: (old pipeline index, node, stage GPUs, offset of the stage)
    holders: dict[int, list[tuple[int, str, int, int]]] = {}
    for p_index, pipe in enumerate(old.pipelines):
        for stage in pipe.template.stages:
            node = pipe.nodes[stage.node]
            if node in lost:
                continue
            for lay in range(stage.layer_start, stage.layer_end):
                holders.setdefault(lay, []).append((p_index, node, stage.gpus, stage.gpu_offset))
    load = [0] * len(old.pipelines)
    transfers: list[LayerTransfer] = []
    missing: set[int] = set()
    for pipe in new.pipelines:
        for stage in pipe.template.stages:
            node = pipe.nodes[stage.node]
            for lay in range(stage.layer_start, stage.layer_end):
                size = layers[lay].param_bytes + layers[lay].optimizer_bytes
                for i in range(stage.gpus):
                    gpu = stage.gpu_offset + i
                    mine = held.get((node, gpu), set())
                    if (lay, i, stage.gpus) in mine:
                        continue
                    options = holders.get(lay, [])
                    if not options:
                        missing.add(lay)
                        continue
                    local = [h for h in options if h[1] == node]
                    src = local[0] if local else min(options, key=lambda h: (load[h[0]], h[0]))
                    p_index, src_node, src_gpus, src_offset = src
                    for j, nbytes in _overlaps(i, stage.gpus, src_gpus, size):
                        if (lay, j, src_gpus) in mine:
                            continue  # this part of the new shard is already on the GPU
                        if not local:
                            load[p_index] += nbytes
                        transfers.append(
                            LayerTransfer(
                                layer=lay,
                                shard=i,
                                shards=stage.gpus,
                                src_shard=j,
                                src_shards=src_gpus,
                                src=position[src_node] * g + src_offset + j,
                                dst=position[node] * g + gpu,
                                nbytes=nbytes,
                                network=not local,
                            )
                        )
    return transfers, sorted(missing)


def _overlaps(shard: int, shards: int, src_shards: int, size: int) -> list[tuple[int, int]]:
    """(old shard, bytes) pieces of new shard ``shard``/``shards`` under the old sharding."""
    unit = shards * src_shards  # both shardings are whole numbers of these units
    start, end = shard * src_shards, (shard + 1) * src_shards
    out = []
    for j in range(start // shards, (end - 1) // shards + 1):
        piece = min(end, (j + 1) * shards) - max(start, j * shards)
        out.append((j, size * piece // unit))
    return out
