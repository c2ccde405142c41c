"""``bulkhead plan JOB.yaml --nodes N [--fail K]``: show what the planners decide for a job.

Prints rich tables: pipeline templates, the chosen pipelines and batch split, the expert
placement of the first MoE layer with its recovery probability against a spread placement,
and what moves when K nodes fail. ``--json FILE`` writes the same plans as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from bulkhead.api.manifest import ManifestError, load_job
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.parallel.pipeline_plan import unit_fetches
from bulkhead.trainer.parallel.plan import ParallelPlan, make_plan
from bulkhead.trainer.parallel.rank_memory import RankMemory, rank_memory
from bulkhead.trainer.planning.costs import GpuSpec, LayerCost, estimate_layer_costs
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.expert_migration import replace_after_failure
from bulkhead.trainer.planning.experts import (
    allocate_replicas,
    place_experts,
    spread_placement,
    zipf_loads,
)
from bulkhead.trainer.planning.instantiate import Instantiation, instantiate
from bulkhead.trainer.planning.reconfigure import reconfigure
from bulkhead.trainer.planning.recovery import recovery_probability
from bulkhead.trainer.planning.templates import TemplateSet, generate_templates

GIB = 2**30
SHOWN = 8  # rows of long tables shown at each end


def _rows(items: list[Any]) -> list[Any]:
    """All items, or the first and last SHOWN with a gap marker (None) between them."""
    return items if len(items) <= 2 * SHOWN else [*items[:SHOWN], None, *items[-SHOWN:]]


def _secs(value: float) -> str:
    """Seconds with 4 significant digits: tiny test models and large jobs both read well."""
    return f"{value:.4g}"


def _layer_counts(stages: Any, width: int = 32) -> str:
    text = ",".join(str(s.layer_end - s.layer_start) for s in stages)
    return text if len(text) <= width else text[: width - 3].rsplit(",", 1)[0] + ",..."


def templates_table(templates: TemplateSet) -> Table:
    table = Table(title=f"Pipeline templates (n0 = {templates.min_nodes})")
    for col in ("nodes", "stages", "layers per stage", "GPUs/stage", "1F1B s", "max GiB/GPU"):
        table.add_column(col, justify="right" if col != "layers per stage" else "left")
    for t in _rows(list(templates.templates)):
        if t is None:
            table.add_row("...", "", "", "", "", "")
            continue
        gpus = sorted({s.gpus for s in t.stages})
        mem = max(s.memory_bytes for s in t.stages) / GIB
        table.add_row(
            str(t.num_nodes), str(t.num_stages), _layer_counts(t.stages),
            ",".join(map(str, gpus)), _secs(t.iteration_time_s), f"{mem:.1f}",
        )  # fmt: skip
    return table


def pipelines_table(plan: Instantiation, title: str, fates: tuple[str, ...] = ()) -> Table:
    table = Table(title=f"{title}: {_secs(plan.iteration_time_s)} s per iteration")
    for col in ("pipeline", "nodes", "stages", "micro-batches", "time s", "fate"):
        table.add_column(col, justify="left" if col in ("nodes", "fate") else "right")
    for i, p in enumerate(plan.pipelines):
        nodes = p.nodes[0] if len(p.nodes) == 1 else f"{p.nodes[0]} .. {p.nodes[-1]}"
        table.add_row(
            str(i), f"{nodes} ({len(p.nodes)})", str(p.template.num_stages),
            str(p.microbatches), _secs(p.time_ns * 1e-9), fates[i] if fates else "",
        )  # fmt: skip
    return table


def transfers_table(transfers: Any) -> Table:
    table = Table(title="What moves: layer shards fetched by new owners (new ranks)")
    for col in ("layer", "shard", "from rank", "to rank", "MiB", "network"):
        table.add_column(col, justify="right")
    for t in _rows(list(transfers)):
        if t is None:
            table.add_row("...", "", "", "", "", "")
            continue
        table.add_row(
            str(t.layer), f"{t.shard + 1}/{t.shards}", str(t.src), str(t.dst),
            f"{t.nbytes / 2**20:.1f}", "yes" if t.network else "no",
        )  # fmt: skip
    return table


def ranks_memory(plan: ParallelPlan, cfg: TrainConfig) -> list[RankMemory]:
    """The planner's prediction of every rank's state and peak activations."""
    from bulkhead.trainer.engine.groups import group_sizes  # imports torch

    per_group = group_sizes(cfg.family, cfg.model, plan.experts is not None)
    return [
        rank_memory(plan, cfg.shape, per_group, rank, cfg.precision, cfg.activation_checkpointing)
        for rank in range(plan.world_size)
    ]


def _memory_cells(memory: RankMemory) -> list[str]:
    return [f"{memory.state.total / 2**20:.2f} / {memory.activations / 2**20:.2f}"]


MEMORY_COLUMNS = ("MiB state / activations",)


def engine_plan_table(plan: ParallelPlan, title: str, cfg: TrainConfig) -> Table:
    """Every rank's batch share and place in the ZeRO mesh, or its pipeline stage, and
    the memory the planner predicts for it (``parallel.rank_memory``)."""
    memory = ranks_memory(plan, cfg)
    if plan.pipelines is not None:
        return _stages_table(plan, title, cfg, memory)
    table = Table(title=f"{title}: " + "; ".join(plan.describe()[1:]))
    table.caption = _memory_caption(cfg)
    for col in ("rank", "worker", "samples", "shard", "replica group", "checkpoint shard",
                "persists", *MEMORY_COLUMNS):  # fmt: skip
        table.add_column(col)
    z = plan.zero
    for rank in _rows(list(range(plan.world_size))):
        if rank is None:
            table.add_row("...", *[""] * (6 + len(MEMORY_COLUMNS)))
            continue
        start, size = plan.share(rank)
        table.add_row(
            str(rank), plan.workers[rank], f"{start}..{start + size - 1}" if size else "-",
            str(z.shard_index(rank)), str(z.replica_index(rank)), plan.checkpoint_shard(rank),
            "yes" if plan.persists(rank) else "", *_memory_cells(memory[rank]),
        )  # fmt: skip
    return table


def _memory_caption(cfg: TrainConfig) -> str:
    return (
        "state: fp32 parameters, gradients and AdamW state held between steps; activations: "
        f"the most kept for backward at once ({cfg.precision}, checkpointing "
        f"{cfg.activation_checkpointing})"
    )


def _stages_table(
    plan: ParallelPlan, title: str, cfg: TrainConfig, memory: list[RankMemory]
) -> Table:
    """Every rank's stage, its share of the batch, its predicted memory and its experts."""
    layout = plan.pipelines
    assert layout is not None
    table = Table(title=f"{title}: {plan.describe()[1]}")
    # What a stage's processes share (their micro-batches, ZeRO, experts) under the table.
    inside = ("each stage", "ZeRO", "experts inside")
    lines = [line.rstrip(":") for line in plan.describe() if line.startswith(inside)]
    table.caption = "; ".join([*lines, _memory_caption(cfg)])
    columns = ["rank", "worker", "pipeline", "stage", "units", "micro-batches", "samples",
               *MEMORY_COLUMNS]  # fmt: skip
    ep = plan.experts
    if ep is not None:
        columns.append("experts hosted")
    for col in columns:
        table.add_column(col)
    for rank in _rows(list(range(plan.world_size))):
        if rank is None:
            table.add_row("...", *[""] * (len(columns) - 1))
            continue
        stage = layout.stage(rank)
        if stage is None:
            table.add_row(str(rank), plan.workers[rank], "idle", *[""] * (len(columns) - 3))
            continue
        rows = layout.rows(stage.pipeline, rank)
        cells = [
            str(rank), plan.workers[rank], str(stage.pipeline),
            f"{stage.index + 1}/{stage.stages}", f"{stage.start}-{stage.stop - 1}",
            str(len(rows)), str(sum(len(r) for r in rows)), *_memory_cells(memory[rank]),
        ]  # fmt: skip
        if ep is not None:
            hosted = ep.hosted(rank % plan.processes_per_worker)
            cells.append(
                " ".join(
                    f"b{layer}:{','.join(map(str, es))}"
                    for layer, es in hosted.items()
                    if layer + 1 in range(stage.start, stage.stop)
                )
            )
        table.add_row(*cells)
    return table


def fetches_table(before: ParallelPlan, after: ParallelPlan) -> tuple[Table, list[Any]]:
    """The units each survivor fetches after the change, and from which holders."""
    assert before.pipelines is not None and after.pipelines is not None
    fetches = unit_fetches(before.pipelines, before.workers, after.pipelines, after.workers)
    table = Table(title="What moves: units (parameters and optimizer state) fetched in process")
    for col in ("worker", "unit", "from one of"):
        table.add_column(col)
    for f in _rows(fetches):
        if f is None:
            table.add_row("...", "", "")
            continue
        table.add_row(f.worker, str(f.unit), ", ".join(f.holders) or "no survivor: checkpoint")
    return table, fetches


def engine_plan_dict(plan: ParallelPlan, cfg: TrainConfig) -> dict[str, Any]:
    z = plan.zero
    memory = ranks_memory(plan, cfg)
    return {
        "describe": plan.describe(),
        "zero": {
            "stage": z.stage,
            "shardSize": z.shard_size,
            "replicas": z.replicas,
            "hpz": z.hpz,
        },
        "pipelines": [
            {
                "stages": [
                    {"worker": plan.workers[s.rank], "units": [s.start, s.stop]} for s in stages
                ],
                "microbatches": plan.pipelines.microbatches[p][1],
            }
            for p, stages in enumerate(plan.pipelines.stages)
        ]
        if plan.pipelines is not None
        else None,
        "ranks": [
            {
                "rank": r,
                "share": list(plan.share(r)),
                "shard": z.shard_index(r),
                "replica": z.replica_index(r),
                "checkpointShard": plan.checkpoint_shard(r),
                "persists": plan.persists(r),
                "memoryBytes": {
                    "params": memory[r].state.params,
                    "grads": memory[r].state.grads,
                    "optimizer": memory[r].state.optimizer,
                    "activations": memory[r].activations,
                },
            }
            for r in range(plan.world_size)
        ],
    }


def _node_names(count: int) -> list[str]:
    return [f"node-{i}" for i in range(count)]


@click.command("plan")
@click.argument("job_file", type=click.Path(path_type=Path))
@click.option("--nodes", "-n", type=click.IntRange(min=1), help="Nodes (default: spec.workers).")
@click.option(
    "--fail", "fail", type=click.IntRange(min=0), default=0,
    help="Nodes to lose (the first pipeline's first nodes) to show what moves.",
)  # fmt: skip
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--gpu-memory-gb", type=click.FloatRange(min=0.1), default=80.0, show_default=True)
@click.option("--gpu-tflops", type=click.FloatRange(min=0.1), default=989.0, show_default=True)
@click.option("--slots-per-gpu", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--expert-skew", type=click.FloatRange(min=0), default=1.0, show_default=True,
    help="Zipf exponent of the synthetic expert loads (0 = uniform).",
)  # fmt: skip
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write plans as JSON.")
def plan(
    job_file: Path,
    nodes: int | None,
    fail: int,
    gpus_per_node: int,
    gpu_memory_gb: float,
    gpu_tflops: float,
    slots_per_gpu: int,
    expert_skew: float,
    json_out: Path | None,
) -> None:
    """Show the pipeline templates, pipelines, expert placement and failure plan of a job."""
    try:
        job = load_job(job_file)
        cfg, sizes_note = _plan_config(job.spec)
    except (ManifestError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    spec = job.spec
    n = nodes or spec.workers
    f = spec.fault_tolerance.max_failures
    batch = spec.trainer.batch
    microbatches = max(1, batch.global_batch_size // batch.micro_batch_size)
    gpu = GpuSpec(
        gpus_per_node=gpus_per_node,
        memory_bytes=int(gpu_memory_gb * GIB),
        peak_flops=gpu_tflops * 1e12,
    )
    console = Console()
    out: dict[str, Any] = {"job": job.metadata.name, "nodes": n, "faultTolerance": f}
    if sizes_note:
        console.print(f"[yellow]{sizes_note}[/yellow]")
    out |= _engine_plans(console, cfg, spec.workers, fail)
    console.print(f"[dim]Below: the planners at cluster scale, {gpus_per_node} GPUs per node "
                  "(the engine above runs one trainer process per GPU).[/dim]")  # fmt: skip
    try:
        layers = estimate_layer_costs(cfg.shape, gpu, batch.micro_batch_size, cfg.precision,
                                      cfg.activation_checkpointing)  # fmt: skip
        templates = generate_templates(layers, gpu, n)
        console.print(templates_table(templates))
        chosen = instantiate(templates, _node_names(n), f, microbatches)
        console.print(pipelines_table(chosen, f"{len(chosen.pipelines)} pipelines on {n} nodes"))
        need = max(s.memory_bytes for p in chosen.pipelines for s in p.template.stages)
        console.print(
            f"Fits: the most loaded GPU needs {need / GIB:.1f} GiB (training state and "
            f"{cfg.precision} activations, checkpointing {cfg.activation_checkpointing}) "
            f"of {gpu.usable_memory_bytes / GIB:.1f} GiB usable "
            f"({gpu_memory_gb:g} GiB GPUs, {gpus_per_node} per node)"
        )
        out["memory"] = {"maxBytesPerGpu": need, "usableBytesPerGpu": gpu.usable_memory_bytes}
        out |= {"templates": templates.to_dict(), "plan": chosen.to_dict()}
        lost = list(chosen.pipelines[0].nodes[:fail])
        if fail:
            if fail > len(chosen.pipelines[0].nodes):
                lost = chosen.nodes[:fail]
            out["reconfiguration"] = _reconfiguration(
                console, chosen, templates, lost, layers, f"After losing {fail}"
            )
        if cfg.shape.moe_blocks:
            out["experts"] = _experts(console, cfg.shape.num_experts, n, gpus_per_node,
                                      slots_per_gpu, spec, expert_skew, fail, lost)  # fmt: skip
    except PlanError as exc:
        raise click.ClickException(str(exc)) from None
    if json_out:
        json_out.write_text(json.dumps(out, indent=2))
        console.print(f"wrote {json_out}")


def _engine_plans(console: Console, cfg: TrainConfig, workers: int, fail: int) -> dict[str, Any]:
    """What this version's engine trains on ``workers`` pods, and after losing ``fail``."""
    pods = [f"w{i}" for i in range(workers)]

    def ranks_of(workers: list[str]) -> list[str]:  # each pod's G processes, by rank
        return [w for w in workers for _ in range(cfg.parallelism.processes_per_worker)]

    out: dict[str, Any] = {}
    trained = make_plan(1, ranks_of(pods), ranks_of(pods), cfg)
    console.print(engine_plan_table(trained, "What this version's engine trains", cfg))
    out["engine"] = engine_plan_dict(trained, cfg)
    if not fail:
        return out
    survivors = ranks_of(pods[fail:] or pods[:1])
    after = make_plan(2, survivors, survivors, cfg)
    title = f"The engine after losing {fail} worker(s)"
    console.print(engine_plan_table(after, title, cfg))
    out["engineAfterFailure"] = engine_plan_dict(after, cfg)
    if trained.pipelines is not None and after.pipelines is not None:
        table, fetches = fetches_table(trained, after)
        console.print(table)
        lost = sorted({f.unit for f in fetches if not f.holders})
        console.print(
            f"units to fetch: {len(fetches)}; units with no surviving holder "
            f"(restored from the checkpoint): {lost or 'none'}"
        )
        out["engineFetches"] = [
            {"worker": f.worker, "unit": f.unit, "holders": list(f.holders)} for f in fetches
        ]
    return out


def _reconfiguration(
    console: Console,
    chosen: Instantiation,
    templates: TemplateSet,
    lost: list[str],
    layers: list[LayerCost],
    title: str,
) -> dict[str, Any]:
    """The cluster-scale plan after losing ``lost``: pipelines, shards that move."""
    result = reconfigure(chosen, templates, lost, layers)
    console.print(pipelines_table(result.plan, title, result.fates))
    console.print(transfers_table(result.transfers))
    console.print(
        f"layer shards to fetch: {len(result.transfers)}, "
        f"{result.network_bytes / GIB:.2f} GiB over the network; "
        f"layers lost with every replica: {list(result.missing_layers) or 'none'}"
    )
    return result.to_dict()


def _plan_config(spec: Any) -> tuple[TrainConfig, str | None]:
    """The job's config and a note when its sizes come from the spec alone: a pretrained
    checkpoint not mounted here (e.g. on the cluster's PVC) is planned from the spec's
    explicit sizes, which the job checks against the checkpoint's config.json at start."""
    model = spec.trainer.model
    pretrained = model.pretrained
    if pretrained is None or (Path(pretrained.path) / "config.json").is_file():
        return train_config(spec), None
    if not {"d_model", "n_layers"} <= model.model_fields_set:
        raise ValueError(
            f"spec.trainer.model.pretrained.path: {pretrained.path}/config.json is not readable "
            "here; run plan where it is mounted, or give the model's sizes in the spec"
        )
    trainer = spec.trainer.model_copy(
        update={"model": model.model_copy(update={"pretrained": None})}
    )
    note = (
        f"{pretrained.path}/config.json is not readable here: planning the sizes the spec "
        "gives (the job checks them against config.json when it starts)"
    )
    return train_config(spec.model_copy(update={"trainer": trainer})), note


def _experts(
    console: Console, experts: int, n: int, gpus: int, slots_per_gpu: int, spec: Any,
    skew: float, fail: int, lost: list[str],
) -> dict[str, Any]:  # fmt: skip
    experts_cfg = spec.trainer.parallelism.experts
    f = (experts_cfg.min_replicas if experts_cfg else None) or spec.fault_tolerance.max_failures + 1
    slots = gpus * slots_per_gpu
    loads = zipf_loads(experts, skew)
    replicas = allocate_replicas(loads, n, slots, f)
    names = _node_names(n)
    target = max(1, spec.fault_tolerance.max_failures, fail)
    placement = place_experts(replicas, names, slots, loads, failures=target)
    table = Table(title=f"Expert placement, first MoE layer ({experts} experts, {slots} slots)")
    table.add_column("node")
    table.add_column("experts in slots")
    for row in _rows(list(zip(names, placement.slots, strict=True))):
        table.add_row(*(("...", "") if row is None else (row[0], " ".join(map(str, row[1])))))
    console.print(table)
    spread = spread_placement(replicas, names, slots)
    prob = Table(title="Recovery probability (all experts survive k random node failures)")
    for col in ("k", "MRO", "spread"):
        prob.add_column(col, justify="right")
    figures = {}
    for k in range(1, min(n - 1, max(target, 4)) + 1):
        ours, base = recovery_probability(placement, k), recovery_probability(spread, k)
        prob.add_row(str(k), f"{float(ours):.4f}", f"{float(base):.4f}")
        figures[k] = {"mro": float(ours), "spread": float(base)}
    console.print(prob)
    out: dict[str, Any] = {"replicas": replicas, "loads": loads, "recovery": figures,
                           "placement": placement.to_dict()}  # fmt: skip
    if fail and lost:
        mig = replace_after_failure(placement, lost, loads, f, failures=target)
        moves = Table(title="What moves: expert replicas copied after the failure")
        for col in ("expert", "from", "to", "slot"):
            moves.add_column(col)
        for m in _rows(list(mig.moves)):
            moves.add_row(*(("...", "", "", "") if m is None else
                            (str(m.expert), m.src, m.dst, str(m.slot))))  # fmt: skip
        console.print(moves)
        console.print(
            f"experts to migrate after losing {len(lost)} nodes: {len(mig.moves)} replicas; "
            f"lost with every replica: {list(mig.missing_experts) or 'none'}"
        )
        out["migration"] = mig.to_dict()
    return out
