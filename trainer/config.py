"""The trainer's one config object, resolved from a TrainingJobSpec.

``spec.trainer.model`` may name a preset (tiny, tiny-moe, small, small-moe); every field
the manifest gives overrides it, also at its default value (``GivenSettings``: the wire
form a worker receives carries only the given fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bulkhead.api.spec import (
    MODEL_DEFAULTS,
    MOE_DEFAULTS,
    DataConfig,
    EvalConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    TrainingJobSpec,
)

if TYPE_CHECKING:  # the families import torch; planning imports this module without it
    from bulkhead.trainer.models.protocol import ModelFamily
    from bulkhead.trainer.planning.costs import ModelShape

# Each preset is a complete set of ModelConfig fields (wire names are not used here).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "ffn_dim": 256},
    "tiny-moe": {
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "seq_len": 64,
        "ffn_dim": 128,
        "moe": {"num_experts": 4, "top_k": 2, "every": 2, "load_balance_coef": 0.01},
    },
    "small": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128, "ffn_dim": 512},
    "small-moe": {
        "d_model": 128,
        "n_layers": 4,
        "n_heads": 4,
        "seq_len": 128,
        "ffn_dim": 256,
        "moe": {"num_experts": 8, "top_k": 2, "every": 2, "load_balance_coef": 0.01},
    },
}

# How long one membership long poll may wait at the control endpoint (which caps it at a
# quarter of the hang timeout). A poll answers at once when a generation is published, so
# its length only sets the steady re-poll rate: 16,384 workers / 30 s = 546 requests/s.
MEMBERSHIP_POLL_SECONDS = 30.0


@dataclass(frozen=True)
class MoESizes:
    num_experts: int
    top_k: int
    every: int
    load_balance_coef: float


@dataclass(frozen=True)
class ModelSizes:
    """Concrete model dimensions (no presets, no optionals except ``moe``)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    ffn_dim: int
    dropout: float
    moe: MoESizes | None = None

    def is_moe_block(self, layer: int) -> bool:
        """Whether decoder block ``layer`` (0-based) uses an MoE feed-forward."""
        return self.moe is not None and (layer + 1) % self.moe.every == 0


# The ModelConfig fields that size the gpt family (ModelSizes' fields but its experts).
_SIZE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "ffn_dim", "dropout")


def resolve_model(model: ModelConfig) -> ModelSizes:
    """Concrete sizes: the defaults, then the preset, then every field the manifest gives
    (only the fields ``ModelSizes`` has: the gpt family's ``sizes`` refuses the others)."""
    given = model.given()
    values: dict[str, Any] = {name: MODEL_DEFAULTS.get(name) for name in _SIZE_FIELDS}
    preset = PRESETS[model.preset] if model.preset is not None else {}
    values.update({k: v for k, v in preset.items() if k != "moe"})
    values.update({k: v for k, v in given.items() if k in _SIZE_FIELDS})
    # The experts: the preset's, each field the manifest gives overriding it.
    moe_given = model.moe.given() if model.moe is not None else None
    moe_sizes = None
    if moe_given is not None or "moe" in preset:
        merged = {**MOE_DEFAULTS, **preset.get("moe", {}), **(moe_given or {})}
        moe_sizes = MoESizes(**MoEConfig.model_validate(merged).given())
    d_model = values["d_model"]
    if d_model % values["n_heads"]:
        raise ValueError(
            f"spec.trainer.model.nHeads: must divide dModel ({d_model}), got {values['n_heads']}"
        )
    if moe_sizes is not None and moe_sizes.every > values["n_layers"]:
        raise ValueError(
            f"spec.trainer.model.moe.every: must be <= nLayers ({values['n_layers']}) "
            f"or no block would be MoE, got {moe_sizes.every}"
        )
    return ModelSizes(
        vocab_size=values["vocab_size"],
        d_model=d_model,
        n_layers=values["n_layers"],
        n_heads=values["n_heads"],
        seq_len=values["seq_len"],
        ffn_dim=values.get("ffn_dim") or 4 * d_model,
        dropout=values["dropout"],
        moe=moe_sizes,
    )


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the runtime, in seconds (from spec.faultTolerance)."""

    collective_s: float = 30.0
    # A collective still waiting this long when a newer generation exists is abandoned
    # (healthy collectives take milliseconds; a rank whose peer died may never see an error).
    abandon_after_s: float = 0.5
    registration_s: float = 300.0
    hang_s: float = 120.0  # the job's hangTimeoutSeconds, told to the node agent
    membership_poll_s: float = MEMBERSHIP_POLL_SECONDS
    # The completion report waits this long for the last progress report's answer.
    report_flush_s: float = 10.0

    @property
    def peer_probe_s(self) -> float:
        """How long a failed collective's peer probe waits for each peer: a fraction of the
        collective timeout, so a partition is named well before the next one expires."""
        return min(3.0, max(0.5, self.collective_s / 4))


@dataclass(frozen=True)
class ExpertParallelism:
    """Lazarus expert parallelism (see ``api.spec.ExpertParallelConfig``)."""

    min_replicas: int  # replicas of every expert on distinct workers (>= max_failures + 1)
    slots_per_worker: int | None  # expert replicas per worker per MoE layer (None = fewest)
    rebalance_interval_steps: int  # 0 = never
    concentration_slack: float  # see planning.dispatch_quotas.concentrated_capacities


@dataclass(frozen=True)
class PipelineParallelism:
    """Oobleck pipelines (see ``api.spec.PipelineConfig``)."""

    min_stages: int = 1
    max_stages: int | None = None
    schedule: str = "1F1B"  # or "GPipe"


@dataclass(frozen=True)
class Parallelism:
    """What the engine shards and how many copies of the state it keeps."""

    zero_stage: int = 0
    hpz: int = 1  # hpZ secondary partition size (1 = off)
    max_failures: int = 0  # f: the state is kept on f + 1 worker pods
    processes_per_worker: int = 1  # G: ranks per worker pod, consecutive in rank order
    experts: ExpertParallelism | None = None
    pipeline: PipelineParallelism | None = None


def _default_family() -> ModelFamily:
    from bulkhead.trainer.models.registry import family

    return family("gpt")


@dataclass(frozen=True)
class TrainConfig:
    """Everything the trainer needs, concrete and immutable.

    ``model`` is the family's size object (``family.sizes(spec.trainer.model)``; the
    engine reads only what ``protocol.SizesLike`` lists), ``family`` builds the model.
    """

    model: Any  # the family's sizes (ModelSizes for ``gpt``)
    optimizer: OptimizerConfig
    global_batch_size: int
    micro_batch_size: int
    steps: int
    seed: int
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig | None = None  # spec.trainer.eval: validation loss, if set
    log_interval_steps: int = 1
    report_interval_s: float = 0.5  # the job's reportIntervalSeconds
    timeouts: Timeouts = field(default_factory=Timeouts)
    parallelism: Parallelism = field(default_factory=Parallelism)
    family: ModelFamily = field(default_factory=_default_family)
    # A directory of pretrained weights a fresh start reads instead of the seeded
    # initialization (``spec.trainer.model.pretrained.path``).
    pretrained: str | None = None
    precision: str = "fp32"  # spec.trainer.precision: "fp32" or "bf16"
    activation_checkpointing: str = "none"  # spec.trainer.activationCheckpointing

    @property
    def shape(self) -> ModelShape:
        """The planners' view of the model (its units' sizes; built on the meta device)."""
        from bulkhead.trainer.models.protocol import model_shape

        return model_shape(self.family, self.model)

    @property
    def aux_coef(self) -> float:
        """Weight of the MoE auxiliary loss (0 for a dense model)."""
        moe = getattr(self.model, "moe", None)
        return moe.load_balance_coef if moe is not None else 0.0


def train_config(spec: TrainingJobSpec) -> TrainConfig:
    """Resolve a validated spec into the trainer's config (raises ValueError on bad sizes)."""
    trainer = spec.trainer
    if trainer.data.format == "text" and trainer.model.vocab_size < 256:
        raise ValueError(
            "spec.trainer.model.vocabSize: byte-level text data needs >= 256, "
            f"got {trainer.model.vocab_size}"
        )
    ft = spec.fault_tolerance
    from bulkhead.trainer.models.registry import family as find_family  # imports torch

    family = find_family(trainer.model.family)
    model = family.sizes(trainer.model)
    return TrainConfig(
        model=model,
        family=family,
        pretrained=_pretrained_path(trainer.model),
        optimizer=trainer.optimizer,
        global_batch_size=trainer.batch.global_batch_size,
        micro_batch_size=trainer.batch.micro_batch_size,
        steps=trainer.steps,
        seed=trainer.seed,
        data=trainer.data,
        eval=trainer.eval,
        precision=trainer.precision,
        activation_checkpointing=trainer.activation_checkpointing,
        log_interval_steps=trainer.log_interval_steps,
        report_interval_s=trainer.report_interval_seconds,
        timeouts=Timeouts(
            collective_s=ft.collective_timeout_seconds,
            registration_s=ft.registration_timeout_seconds,
            hang_s=ft.hang_timeout_seconds,
        ),
        parallelism=Parallelism(
            zero_stage=trainer.parallelism.zero.stage,
            hpz=trainer.parallelism.zero.hpz_partition_size,
            max_failures=ft.max_failures,
            processes_per_worker=spec.trainer_processes,
            experts=_expert_parallelism(spec, model),
            pipeline=_pipeline_parallelism(spec, model),
        ),
    )


def _pipeline_parallelism(spec: TrainingJobSpec, model: Any) -> PipelineParallelism | None:
    pipeline = spec.trainer.parallelism.pipeline
    if pipeline is None:
        return None
    units = model.n_layers + 2  # the embedding, every block, the head
    if pipeline.min_stages > units:
        raise ValueError(
            "spec.trainer.parallelism.pipeline.minStages: the model splits into at most "
            f"{units} stages (embedding, {model.n_layers} blocks, head), got {pipeline.min_stages}"
        )
    return PipelineParallelism(
        min_stages=pipeline.min_stages,
        max_stages=pipeline.max_stages,
        schedule=pipeline.schedule,
    )


def _expert_parallelism(spec: TrainingJobSpec, model: Any) -> ExpertParallelism | None:
    """The experts block with its defaults resolved against the model and the workers."""
    experts = spec.trainer.parallelism.experts
    if experts is None:
        return None
    if model.moe is None:
        raise ValueError(
            "spec.trainer.parallelism.experts: expert parallelism needs a Mixture-of-Experts model"
        )
    # Under pipelines a stage's experts are spread over its pod's processes and the
    # pipelines are the copies; otherwise replicas sit on distinct workers.
    if spec.trainer.parallelism.pipeline is not None:
        holders, replicas = spec.trainer_processes, experts.min_replicas or 1
    else:
        holders = spec.workers
        replicas = experts.min_replicas or spec.fault_tolerance.max_failures + 1
    fewest = -(-model.moe.num_experts * replicas // holders)
    slots = experts.slots_per_worker
    if slots is not None and slots < fewest:
        raise ValueError(
            f"spec.trainer.parallelism.experts.slotsPerWorker: {holders} holders x "
            f"{slots} slots cannot hold {replicas} replicas of each of "
            f"{model.moe.num_experts} experts; needs >= {fewest}, got {slots}"
        )
    return ExpertParallelism(
        min_replicas=replicas,
        slots_per_worker=slots,
        rebalance_interval_steps=experts.rebalance_steps(
            spec.trainer.parallelism.pipeline is not None
        ),
        concentration_slack=experts.slack(),
    )


def _pretrained_path(model: ModelConfig) -> str | None:
    """``spec.trainer.model.pretrained.path`` (None when unset)."""
    pretrained = getattr(model, "pretrained", None)
    return getattr(pretrained, "path", None) if pretrained is not None else None
