"""TrainingJob spec models: the single source of the CRD schema and of manifest validation.

Field names are camelCase on the wire (YAML/JSON) and snake_case in Python. Every
cross-field rule names the field it is about (see ``_rule``), so an error always says
which field to fix. Rules that the API server can check itself are also exported as CEL
(``x-kubernetes-validations``) into the CRD by ``bulkhead.api.crd``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

API_GROUP = "bulkhead.dev"
API_VERSION = "v1alpha1"
KIND = "TrainingJob"

Severity = Literal["info", "warning", "critical"]
ModelPreset = Literal["tiny", "tiny-moe", "small", "small-moe"]


def _rule(
    field: str, message: str, got: dict[str, Any] | None = None, **ctx: Any
) -> PydanticCustomError:
    """A cross-field error located at ``field`` (dotted, camelCase, relative to the model).

    A rule the CRD checks too passes its ``cel`` twin's ``message`` unchanged and the values
    it compares as ``got``: `kubectl apply` and `bulkhead validate` then refuse a spec in
    the same words, validate adding the values (the API server's CEL cannot format numbers
    within the CRD's cost budget). Other rules may use ``{name}`` placeholders from ``ctx``.
    """
    if got:
        message += " (got " + ", ".join(f"{k}={v}" for k, v in got.items()) + ")"
    return PydanticCustomError("cross_field", message, {"field": field, **ctx})


def cel(rule: str, message: str, field: str | None = None) -> dict[str, str]:
    """One CEL validation rule for the CRD; ``field`` names the offending field for kubectl."""
    out = {"rule": rule, "message": message}
    if field:
        out["fieldPath"] = f".{field}"
    return out


class Model(BaseModel):
    """Base: camelCase aliases, unknown fields rejected, validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def wire(self) -> dict[str, Any]:
        """The JSON form as it appears in a manifest (camelCase, no unset optionals)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class SpecModel(Model):
    """Base of the spec: no infinities or NaNs (an infinite timeout is a typo, not a
    setting). Protocol messages may carry measured non-finite values (a NaN loss)."""

    model_config = ConfigDict(allow_inf_nan=False)


def _no_crd_default(schema: dict[str, Any]) -> None:
    """Keeps a field's default out of the CRD, so the API server does not fill it in."""
    schema.pop("default", None)


class GivenSettings(SpecModel):
    """Settings whose defaults a preset or a checkpoint's config.json may replace.

    A field counts as given when the manifest names it, even at its default value (the
    user who writes ``nLayers: 4`` with the ``tiny`` preset gets 4 layers, not the preset's
    2). So the defaults of such fields are kept out of the CRD (``Given``), and the wire
    form a worker receives carries only what was given: the trainer sees the same
    ``given()`` as the manifest's author wrote.
    """

    @model_serializer(mode="wrap")
    def _given_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        fields = type(self).model_fields
        keep = {name for name in self.model_fields_set}
        keep |= {fields[name].alias for name in self.model_fields_set if fields[name].alias}
        return {k: v for k, v in data.items() if k in keep}

    def given(self) -> dict[str, Any]:
        """The fields the manifest names (snake_case), without explicit nulls."""
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name in self.model_fields_set and getattr(self, name) is not None
        }


def Given(default: Any, **kwargs: Any) -> Any:  # a Field() factory, named like Field
    """A ``Field`` of a ``GivenSettings`` whose default stays out of the CRD."""
    return Field(default, json_schema_extra=_no_crd_default, **kwargs)


def _value(field: str, default: Any) -> str:
    """CEL for a field that may be absent (its default then), the twin of ``getattr``."""
    return f"(has(self.{field}) ? self.{field} : {default})"


_TOP_K = "must be <= numExperts"
MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 4, "top_k": 2, "every": 2, "load_balance_coef": 0.01,
}  # fmt: skip


class MoEConfig(GivenSettings):
    """Mixture-of-Experts feed-forward blocks (a preset's experts, overridden by every field
    given here)."""

    num_experts: int = Given(
        MOE_DEFAULTS["num_experts"], ge=2, le=1024, description="Experts per MoE layer (default 4)."
    )
    top_k: int = Given(
        MOE_DEFAULTS["top_k"],
        ge=1,
        le=8,
        description="Experts each token is routed to (default 2).",
    )
    every: int = Given(
        MOE_DEFAULTS["every"],
        ge=1,
        le=1024,
        description="Every n-th decoder block uses an MoE feed-forward (1 = all; default 2; "
        "the mixtral family routes every block).",
    )
    load_balance_coef: float = Given(
        MOE_DEFAULTS["load_balance_coef"],
        ge=0,
        le=1,
        description="Weight of the load-balancing auxiliary loss (default 0.01).",
    )

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            got = {"numExperts": self.num_experts, "topK": self.top_k}
            raise _rule("topK", _TOP_K, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"{_value('topK', MOE_DEFAULTS['top_k'])} <= "
                    f"{_value('numExperts', MOE_DEFAULTS['num_experts'])}",
                    _TOP_K,
                    "topK",
                )
            ]
        },
    )


_FREQ_ORDER = "must be > lowFreqFactor"


class RopeScalingConfig(SpecModel):
    """Llama-3 rotary frequency scaling (Hugging Face ``rope_type: llama3``): wavelengths
    longer than originalMaxPositionEmbeddings / lowFreqFactor are divided by factor, shorter
    than originalMaxPositionEmbeddings / highFreqFactor kept, those between interpolated."""

    rope_type: Literal["llama3"] = Field("llama3", description="The scaling rule (llama3).")
    factor: float = Field(8.0, gt=0, le=1e6, description="Scale of the long wavelengths.")
    # Below highFreqFactor's own maximum: it must stay under highFreqFactor.
    low_freq_factor: float = Field(1.0, gt=0, lt=1e6, description="Low-frequency bound.")
    high_freq_factor: float = Field(4.0, gt=0, le=1e6, description="High-frequency bound.")
    original_max_position_embeddings: int = Field(
        8192, ge=1, le=100_000_000, description="Context length the model was pretrained at."
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> RopeScalingConfig:
        if self.high_freq_factor <= self.low_freq_factor:
            got = {"lowFreqFactor": self.low_freq_factor, "highFreqFactor": self.high_freq_factor}
            raise _rule("highFreqFactor", _FREQ_ORDER, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.highFreqFactor > self.lowFreqFactor",
                    _FREQ_ORDER,
                    "highFreqFactor",
                )
            ]
        },
    )


class PretrainedConfig(SpecModel):
    """Start from a Hugging Face checkpoint instead of random weights."""

    path: str = Field(
        ...,
        min_length=1,
        description=(
            "Directory holding config.json and *.safetensors (sharded with "
            "model.safetensors.index.json or not), e.g. on a PVC. Sizes come from config.json; "
            "explicit model fields must agree with it. Each rank reads only what it holds."
        ),
    )


_HEADS = "must divide dModel"
_KV_HEADS = "must divide nHeads"
_SIZED_ELSEWHERE = "(has(self.preset) || has(self.pretrained))"


# The sizes a model has when neither a preset nor config.json nor the manifest gives them.
MODEL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 64,
    "dropout": 0.0, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}  # fmt: skip


class ModelConfig(GivenSettings):
    """The model: a family (gpt, llama, mixtral or a user's), its sizes (a preset, every
    field given here overriding it, or a Hugging Face config.json) and optional pretrained
    weights."""

    family: str = Field(
        "gpt",
        min_length=1,
        description=(
            "Model family: gpt, llama, mixtral, the name of a bulkhead.models entry point, or "
            "'module:attribute' of a ModelFamily."
        ),
    )
    pretrained: PretrainedConfig | None = Field(
        None, description="Hugging Face weights to start from (llama and mixtral families)."
    )
    preset: ModelPreset | None = Field(
        None, description="Named size; every size field given here overrides it."
    )
    vocab_size: int = Given(
        MODEL_DEFAULTS["vocab_size"],
        ge=2,
        le=1_000_000,
        description="Vocabulary size (default 256: byte-level data uses 256).",
    )
    d_model: int = Given(
        MODEL_DEFAULTS["d_model"],
        ge=8,
        le=65536,
        description="Hidden (embedding) width (default 64).",
    )
    n_layers: int = Given(
        MODEL_DEFAULTS["n_layers"], ge=1, le=1024, description="Transformer blocks (default 4)."
    )
    n_heads: int = Given(
        MODEL_DEFAULTS["n_heads"],
        ge=1,
        le=512,
        description="Attention heads; must divide dModel (default 4).",
    )
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Key/value heads of grouped-query attention (llama, mixtral); must divide "
        "nHeads. Default nHeads.",
    )
    seq_len: int = Given(
        MODEL_DEFAULTS["seq_len"],
        ge=4,
        le=1_000_000,
        description="Tokens per training sequence (default 64; with pretrained weights: the "
        "checkpoint's max_position_embeddings).",
    )
    ffn_dim: int | None = Field(
        None,
        ge=8,
        le=1_048_576,
        description="Feed-forward width (of each expert for MoE); default 4 x dModel.",
    )
    dropout: float = Given(
        MODEL_DEFAULTS["dropout"], ge=0, lt=1, description="Dropout probability (default 0: none)."
    )
    rope_theta: float = Given(
        MODEL_DEFAULTS["rope_theta"],
        gt=0,
        le=1e12,
        description="Rotary embedding base (llama, mixtral; default 10000).",
    )
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="Llama-3 rotary frequency scaling (llama, mixtral); omit for none."
    )
    rms_norm_eps: float = Given(
        MODEL_DEFAULTS["rms_norm_eps"],
        gt=0,
        le=1,
        description="RMSNorm epsilon (llama, mixtral; default 1e-5).",
    )
    tie_embeddings: bool | None = Field(
        None,
        description="Share the embedding and the output head (llama, mixtral; default false; "
        "gpt always ties).",
    )
    moe: MoEConfig | None = Field(None, description="Omit for a dense model.")

    def _sizes_known(self, *names: str) -> bool:
        """Whether ``names`` have their final values here: given, or defaults that no preset
        or config.json replaces (else the trainer checks them once the sizes are resolved)."""
        sized_elsewhere = self.preset is not None or self.pretrained is not None
        return not sized_elsewhere or set(names) <= self.model_fields_set

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self._sizes_known("d_model", "n_heads") and self.d_model % self.n_heads:
            raise _rule("nHeads", _HEADS, {"dModel": self.d_model, "nHeads": self.n_heads})
        if (
            self.n_kv_heads is not None
            and self._sizes_known("n_heads")
            and self.n_heads % self.n_kv_heads
        ):
            raise _rule(
                "nKvHeads", _KV_HEADS, {"nHeads": self.n_heads, "nKvHeads": self.n_kv_heads}
            )
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"{_SIZED_ELSEWHERE} && !(has(self.dModel) && has(self.nHeads)) || "
                    f"{_value('dModel', MODEL_DEFAULTS['d_model'])} % "
                    f"{_value('nHeads', MODEL_DEFAULTS['n_heads'])} == 0",
                    _HEADS,
                    "nHeads",
                ),
                cel(
                    f"!has(self.nKvHeads) || {_SIZED_ELSEWHERE} && !has(self.nHeads) || "
                    f"{_value('nHeads', MODEL_DEFAULTS['n_heads'])} % self.nKvHeads == 0",
                    _KV_HEADS,
                    "nKvHeads",
                ),
            ]
        },
    )


_STAGES = "must be >= minStages"


class PipelineConfig(SpecModel):
    """Oobleck pipelines: heterogeneous pipelines instantiated from precomputed templates.

    For every worker count the planner knows the fastest pipeline layout (a template: the
    model's layers split into stages, one worker pod per stage) and runs at least
    faultTolerance.maxFailures + 1 pipelines side by side, each with the share of the
    global batch (in microBatchSize micro-batches) that makes them finish together. Every
    layer is thus held by maxFailures + 1 workers: after losing workers the survivors
    re-instantiate pipelines from the templates and fetch the layers they now own from
    surviving holders, in process. Fewer than (maxFailures + 1) x minStages workers run
    fewer pipelines (fewer copies), and state no survivor holds comes from the checkpoint.
    """

    min_stages: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Fewest stages (workers) per pipeline, e.g. because the model does not fit on "
            "fewer. With fewer live workers than this, one pipeline of all of them."
        ),
    )
    max_stages: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Most stages per pipeline (default: as many as the planner finds fastest).",
    )
    schedule: Literal["1F1B", "GPipe"] = Field(
        "1F1B",
        description=(
            "Pipeline schedule: 1F1B (one forward, one backward; activations of at most "
            "as many micro-batches as stages kept) or GPipe (all forwards, then all "
            "backwards)."
        ),
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> PipelineConfig:
        if self.max_stages is not None and self.max_stages < self.min_stages:
            got = {"minStages": self.min_stages, "maxStages": self.max_stages}
            raise _rule("maxStages", _STAGES, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.maxStages) || self.maxStages >= self.minStages",
                    _STAGES,
                    "maxStages",
                )
            ]
        },
    )


DEFAULT_REBALANCE_INTERVAL_STEPS = 200
# How much more than the proportional split a worker may compute so that experts go whole
# to one replica (see ExpertParallelConfig.concentration_slack).
DEFAULT_CONCENTRATION_SLACK = 0.25


class ExpertParallelConfig(SpecModel):
    """Lazarus expert parallelism: each worker hosts only some experts of every MoE layer.

    Every expert has several replicas on distinct workers (at least minReplicas), so any
    faultTolerance.maxFailures worker losses leave a replica of every expert: the lost
    replicas are copied (weights and optimizer state) from the survivors in process, with
    no checkpoint reload. Replica counts follow the measured expert load (Lazarus Eq. 1)
    and replicas are placed to maximise the chance of surviving more losses (Maximum Rank
    Overlap). Dense parameters (attention, embeddings, routers) stay data parallel.
    """

    min_replicas: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "Fewest replicas of every expert, each on a different worker (Lazarus f). "
            "Default and minimum: faultTolerance.maxFailures + 1; at most workers. With fewer "
            "live workers than this, every live worker holds every expert."
        ),
    )
    slots_per_worker: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description=(
            "Expert replicas each worker hosts per MoE layer (Lazarus c, the expert memory "
            "budget): workers x slotsPerWorker replicas per layer are shared out by load. "
            "Default and minimum: the fewest that give every expert minReplicas replicas, "
            "ceil(numExperts x minReplicas / workers); raised the same way while fewer "
            "workers are alive."
        ),
    )
    concentration_slack: float | None = Field(
        None,
        ge=0,
        le=16,
        description=(
            "How much more than Lazarus' proportional split a worker may compute so that "
            "an expert's tokens go whole to one of its replicas (fewer, larger expert "
            "products; only the replicas that computed send gradients to the others): "
            "every expert goes to its primary replica unless a worker would then compute "
            "more than (1 + concentrationSlack) x the rows of the proportional split's "
            "busiest worker, and then only the experts that must be split are. 0 keeps "
            "the busiest worker's rows; larger values trade balance for fewer replicas "
            f"computing. Default {DEFAULT_CONCENTRATION_SLACK}."
        ),
    )
    rebalance_interval_steps: int | None = Field(
        None,
        ge=0,
        le=10_000_000,
        description=(
            "Every so many steps the replica counts follow the expert load measured since "
            "the last rebalance and replicas move with the fewest copies (0 = never). "
            f"Default {DEFAULT_REBALANCE_INTERVAL_STEPS}; under pipelines 0, the only value "
            "they support."
        ),
    )

    def slack(self) -> float:
        """The concentration slack in force."""
        if self.concentration_slack is None:
            return DEFAULT_CONCENTRATION_SLACK
        return self.concentration_slack

    def rebalance_steps(self, pipelines: bool) -> int:
        """The interval in force (the default depends on whether pipelines run)."""
        if self.rebalance_interval_steps is not None:
            return self.rebalance_interval_steps
        return 0 if pipelines else DEFAULT_REBALANCE_INTERVAL_STEPS


_HPZ = "hierarchical partitioning applies to ZeRO stage 3 only"


class ZeroConfig(SpecModel):
    """ZeRO sharding of parameters, gradients and optimizer state (FSDP2).

    Sharding happens within shard groups of consecutive ranks; the state is replicated
    across at least faultTolerance.maxFailures + 1 such groups (HSDP), so any maxFailures
    worker losses are recovered in process from the surviving replicas without reading a
    checkpoint. The shard group size is the largest divisor of the live worker count that
    leaves maxFailures + 1 replicas.
    """

    stage: Literal[0, 1, 2, 3] = Field(
        0,
        description=(
            "ZeRO stage: 0 = plain data parallel; 1 = optimizer state sharded; 2 = + "
            "gradients; 3 = + parameters. Each shard lives on maxFailures + 1 workers."
        ),
    )
    hpz_partition_size: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "ZeRO++ hpZ secondary partition size h (stage 3 only; 1 = off): after forward "
            "each rank keeps 1/h of every parameter so the backward all-gather stays within "
            "h consecutive ranks (one node). Must divide the shard group size."
        ),
    )

    @model_validator(mode="after")
    def _hpz_needs_stage_3(self) -> ZeroConfig:
        if self.hpz_partition_size > 1 and self.stage != 3:
            got = {"stage": self.stage, "hpzPartitionSize": self.hpz_partition_size}
            raise _rule("hpzPartitionSize", _HPZ, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.hpzPartitionSize <= 1 || self.stage == 3",
                    _HPZ,
                    "hpzPartitionSize",
                )
            ]
        },
    )


_EXPERTS_ZERO = (
    "expert parallelism is not combined with ZeRO stage > 0 by this version of the engine "
    "(dense parameters stay data parallel): use stage 0"
)


class ParallelismConfig(SpecModel):
    """How the model and its state are split over the workers."""

    pipeline: PipelineConfig | None = Field(
        None,
        description=(
            "Pipeline parallelism (Oobleck): a stage per worker pod. With several processes "
            "per pod, each runs the stage on its part of every micro-batch, ZeRO stage > 0 "
            "shards the stage over them and expert parallelism spreads its experts over "
            "them."
        ),
    )
    experts: ExpertParallelConfig | None = Field(
        None,
        description=(
            "Expert parallelism (Lazarus) for a Mixture-of-Experts model: each worker hosts "
            "some replicas of each MoE layer's experts. Under pipelines the experts of a "
            "stage are spread over its pod's processes (the pipelines hold maxFailures + 1 "
            "copies). Not combined with ZeRO stage > 0 without pipelines by this version of "
            "the engine."
        ),
    )
    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO / hpZ sharding.")

    @model_validator(mode="after")
    def _only_what_the_engine_runs(self) -> ParallelismConfig:
        if self.experts is not None and self.zero.stage > 0 and self.pipeline is None:
            raise _rule("zero.stage", _EXPERTS_ZERO, {"stage": self.zero.stage})
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.pipeline) || !has(self.experts) || self.zero.stage == 0",
                    _EXPERTS_ZERO,
                    "zero.stage",
                ),
            ]
        },
    )


TRAINER_CONTAINER = "trainer"


def trainer_gpus(template: dict[str, Any]) -> int:
    """The nvidia.com/gpu count of a pod template's trainer container (the container named
    ``trainer``, else the first, as the operator picks it); 0 when it asks for none."""
    containers = [c or {} for c in (template.get("spec") or {}).get("containers") or []]
    if not containers:
        return 0
    trainer = next((c for c in containers if c.get("name") == TRAINER_CONTAINER), containers[0])
    resources = trainer.get("resources") or {}
    counts = [(resources.get(kind) or {}).get("nvidia.com/gpu") for kind in ("limits", "requests")]
    found = [int(str(c)) for c in counts if c is not None and str(c).isdigit()]
    return max(found, default=0)


def zero_shard_group_size(workers: int, max_failures: int, processes: int = 1) -> int:
    """Shard group size, in processes, for ``workers`` live worker pods of ``processes``
    trainer processes each that keeps ``max_failures + 1`` replicas.

    ``processes`` times the largest divisor S of ``workers`` with ``workers / S >=
    max_failures + 1``: every process trains, the mesh is rectangular (replicas x shard
    size), a pod's processes share one shard group, so any ``max_failures`` pod losses
    leave at least one holder of every shard. 1 means no sharding (plain data parallel).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    replicas = max_failures + 1
    fitting = [s for s in range(1, workers + 1) if workers % s == 0 and workers // s >= replicas]
    # Fewer workers than copies: every pod holds it all (its processes may still shard it,
    # but a pod's loss would then lose a whole copy with no other holder).
    return max(fitting, default=1) * processes if fitting else 1


_MICRO = "must be <= globalBatchSize"


class BatchConfig(SpecModel):
    """Sequences per optimizer step and per forward/backward pass."""

    global_batch_size: int = Field(
        16, ge=1, le=16_777_216, description="Sequences per optimizer step."
    )
    micro_batch_size: int = Field(4, ge=1, le=65_536, description="Sequences per forward/backward.")

    @model_validator(mode="after")
    def _micro_fits(self) -> BatchConfig:
        if self.micro_batch_size > self.global_batch_size:
            got = {
                "globalBatchSize": self.global_batch_size,
                "microBatchSize": self.micro_batch_size,
            }
            raise _rule("microBatchSize", _MICRO, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.microBatchSize <= self.globalBatchSize",
                    _MICRO,
                    "microBatchSize",
                )
            ]
        },
    )


_MIN_LR = "must be <= lr"
_CONSTANT = "constant keeps lr after the warm-up: minLr and decaySteps apply to cosine and wsd only"


class OptimizerConfig(SpecModel):
    """The optimizer and its learning-rate schedule: a linear warm-up, then ``schedule``."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="adamw or sgd.")
    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=10, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="AdamW beta1 and beta2 (two numbers)."
    )
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Max gradient norm; 0 = no clipping.")
    warmup_steps: int = Field(
        0, ge=0, le=1_000_000_000, description="Steps of linear learning-rate warmup."
    )
    schedule: Literal["constant", "cosine", "wsd"] = Field(
        "constant",
        description=(
            "After the warm-up: constant (lr), cosine (from lr down to minLr over decaySteps) "
            "or wsd (warmup-stable-decay: lr, then a linear decay to minLr over the last "
            "decaySteps steps)."
        ),
    )
    min_lr: float = Field(
        0.0, ge=0, le=10, description="Learning rate at the end of the decay (cosine, wsd)."
    )
    decay_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000_000,
        description=(
            "Steps of the decay. cosine: from the end of the warm-up (default: to the last "
            "step); wsd: the last steps of the run (default: the last 20 %)."
        ),
    )

    @model_validator(mode="after")
    def _schedule_fields(self) -> OptimizerConfig:
        if self.min_lr > self.lr:
            raise _rule("minLr", _MIN_LR, {"lr": self.lr, "minLr": self.min_lr})
        if self.schedule == "constant" and (self.min_lr or self.decay_steps is not None):
            raise _rule("schedule", _CONSTANT)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minLr <= self.lr", _MIN_LR, "minLr"),
                cel(
                    "self.schedule != 'constant' || (self.minLr == 0.0 && !has(self.decaySteps))",
                    _CONSTANT,
                    "schedule",
                ),
            ]
        },
    )


class DataSource(SpecModel):
    """One prepared token directory of a data mix and its weight."""

    path: str = Field(..., min_length=1, description="A directory made by 'bulkhead data prepare'.")
    weight: float = Field(
        ..., gt=0, le=1e6, description="Share of the mix: weight / the sum of the weights."
    )


_TOKENS_NEED_PATH = "format tokens reads prepared directories: set path or mix"
_TOKENS_ONLY = "is read by format tokens only (text reads source)"
_PATH_OR_MIX = "set path or mix, not both"


class DataConfig(SpecModel):
    """Where training tokens come from and how they are shuffled."""

    format: Literal["text", "tokens"] = Field(
        "text",
        description=(
            "text: files read as bytes (vocabulary 256), held in each worker's memory; "
            "tokens: a directory of token shards made by 'bulkhead data prepare', "
            "memory-mapped."
        ),
    )
    source: str = Field(
        "python-stdlib",
        min_length=1,
        description=(
            "text: 'python-stdlib' (the interpreter's own source tree), a directory or a glob."
        ),
    )
    max_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=1 << 40,
        description=(
            "text: bytes read into each worker's memory at most (files in order, the last "
            "one cut). Larger corpora: prepare token shards."
        ),
    )
    path: str | None = Field(
        None,
        min_length=1,
        description="tokens: the prepared directory (its index.json and shards).",
    )
    mix: list[DataSource] | None = Field(
        None,
        min_length=2,
        max_length=64,
        description=(
            "tokens, instead of path: several prepared directories (one tokenizer), each "
            "step drawing from them in proportion to their weights."
        ),
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the data order.")

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.format != 'tokens' || has(self.path) || has(self.mix)",
                    _TOKENS_NEED_PATH,
                    "path",
                ),
                cel(
                    "!has(self.path) || self.format == 'tokens'",
                    _TOKENS_ONLY,
                    "path",
                ),
                cel("!has(self.mix) || self.format == 'tokens'", _TOKENS_ONLY, "mix"),
                cel("!has(self.mix) || !has(self.path)", _PATH_OR_MIX, "mix"),
            ]
        },
    )

    @model_validator(mode="after")
    def _format_fields(self) -> DataConfig:
        if self.format == "tokens" and self.path is None and self.mix is None:
            raise _rule("path", _TOKENS_NEED_PATH)
        if self.format == "text" and self.path is not None:
            raise _rule("path", _TOKENS_ONLY, {"path": self.path})
        if self.format == "text" and self.mix is not None:
            raise _rule("mix", _TOKENS_ONLY)
        if self.path is not None and self.mix is not None:
            raise _rule("mix", _PATH_OR_MIX)
        return self


_ONE_EVAL_SOURCE = "splits the training data, path evaluates on another directory: set one"


class EvalConfig(SpecModel):
    """Validation: the mean loss on held-out samples, every ``intervalSteps`` and after the
    last step; no gradients, no optimizer step."""

    interval_steps: int = Field(
        ..., ge=1, le=1_000_000, description="Evaluate after every n-th step (and the last)."
    )
    batches: int = Field(
        4,
        ge=1,
        le=100_000,
        description=(
            "Batches of globalBatchSize samples per evaluation: the same samples every time, "
            "each rank evaluating its share."
        ),
    )
    held_out_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description=(
            "Without path: the share of the training data's samples (its tail) held out for "
            "evaluation and never trained on (default 0.05)."
        ),
    )
    path: str | None = Field(
        None,
        min_length=1,
        description=(
            "format tokens: a directory made by 'bulkhead data prepare' (same tokenizer) to "
            "evaluate on instead of a held-out split; the training data is then not split."
        ),
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if self.path is not None and self.held_out_fraction is not None:
            raise _rule("heldOutFraction", _ONE_EVAL_SOURCE)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.path) || !has(self.heldOutFraction)",
                    _ONE_EVAL_SOURCE,
                    "heldOutFraction",
                )
            ]
        },
    )

    @property
    def held_out(self) -> float:
        """The held-out share of the training samples (0 when evaluating on ``path``)."""
        if self.path is not None:
            return 0.0
        return self.held_out_fraction if self.held_out_fraction is not None else 0.05


_EVAL_PATH_TOKENS = (
    "is a prepared token directory, read with data format tokens only (text data evaluates "
    "on a held-out split: omit path)"
)
_DECAY_FITS = "warmupSteps + decaySteps must be <= steps"


class TrainerConfig(SpecModel):
    """What each worker trains: model, parallelism, batch, optimizer, data, step count."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    steps: int = Field(200, ge=1, le=1_000_000_000, description="Optimizer steps to train.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig | None = Field(
        None, description="Validation loss on held-out data (omit: no evaluation)."
    )
    seed: int = Field(1234, ge=0, le=2**32 - 1, description="Seed of the model initialisation.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "Compute precision. bf16: forward and backward in bfloat16 (autocast; under "
            "ZeRO, parameters gathered in bf16), with fp32 master weights, optimizer "
            "state, gradient reductions and loss; pipeline activations and expert tokens "
            "travel in bf16. fp32: everything in float32."
        ),
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description=(
            "Recompute decoder blocks' activations in backward instead of keeping them: "
            "none; full (every block); selective (every other block: 1st, 3rd, ...). "
            "Trades about one extra forward of the checkpointed blocks for their memory."
        ),
    )
    log_interval_steps: int = Field(
        1, ge=1, le=1_000_000, description="Progress report every n steps."
    )
    report_interval_seconds: float = Field(
        0.5,
        ge=0,
        le=60,
        description=(
            "At most one progress request to the manager per interval; each carries every "
            "reported step since the last (0: one request per report)."
        ),
    )

    @model_validator(mode="after")
    def _eval_path_is_tokens(self) -> TrainerConfig:
        if self.eval is not None and self.eval.path is not None and self.data.format != "tokens":
            raise _rule("eval.path", _EVAL_PATH_TOKENS, {"path": self.eval.path})
        return self

    @model_validator(mode="after")
    def _schedule_fits(self) -> TrainerConfig:
        opt = self.optimizer
        decay = opt.decay_steps
        if (
            opt.schedule != "constant"
            and decay is not None
            and opt.warmup_steps + decay > self.steps
        ):
            got = {"warmupSteps": opt.warmup_steps, "decaySteps": decay, "steps": self.steps}
            raise _rule("optimizer.decaySteps", _DECAY_FITS, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.eval) || !has(self.eval.path) || self.data.format == 'tokens'",
                    _EVAL_PATH_TOKENS,
                    "eval.path",
                ),
                cel(
                    "self.optimizer.schedule == 'constant' || !has(self.optimizer.decaySteps) "
                    "|| self.optimizer.warmupSteps + self.optimizer.decaySteps <= self.steps",
                    _DECAY_FITS,
                    "optimizer.decaySteps",
                ),
            ]
        },
    )


_BACKOFF = "must be >= initialSeconds"


class BackoffConfig(SpecModel):
    """Wait between full restarts that follow one another with no step trained in between
    (a crash loop): the first restart after training progressed starts at once, the next
    waits initialSeconds, each further one multiplier times longer, capped."""

    # Lower bounds a clock can honour: a 1e-300 s wait is a typo, not a setting.
    initial_seconds: float = Field(
        1.0,
        ge=0.01,
        le=3600,
        description=(
            "Wait before a restart that follows another with no step trained in between "
            "(the first restart after training progressed starts at once)."
        ),
    )
    max_seconds: float = Field(60.0, ge=0.01, le=86_400, description="Longest wait.")
    multiplier: float = Field(2.0, ge=1, le=100, description="Growth of the wait per restart.")

    @model_validator(mode="after")
    def _ordered(self) -> BackoffConfig:
        if self.max_seconds < self.initial_seconds:
            got = {"initialSeconds": self.initial_seconds, "maxSeconds": self.max_seconds}
            raise _rule("maxSeconds", _BACKOFF, got)
        return self

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.maxSeconds >= self.initialSeconds",
                    _BACKOFF,
                    "maxSeconds",
                )
            ]
        },
    )


class FaultToleranceConfig(SpecModel):
    """How many faults the job survives, and how hangs, restarts and bad nodes are handled."""

    max_failures: int = Field(
        0,
        ge=0,
        le=10_000,
        description=(
            "f: simultaneous worker losses survived in process, without a restart: every "
            "piece of training state is kept on at least f + 1 workers."
        ),
    )
    max_restarts: int = Field(
        3, ge=0, le=10_000, description="Full restarts from checkpoint before Failed."
    )
    backoff: BackoffConfig = Field(
        default_factory=BackoffConfig,
        description="Wait between full restarts with no step trained in between.",
    )
    hang_timeout_seconds: float = Field(
        120.0,
        ge=1,
        le=604_800,
        description=(
            "No progress this long = hang. Progress is a completed step, or a new "
            "generation's set-up advancing (its world formed, its state adopted)."
        ),
    )
    registration_timeout_seconds: float = Field(
        300.0, ge=1, le=86_400, description="How long to wait for workers to register."
    )
    collective_timeout_seconds: float = Field(
        30.0, ge=1, le=86_400, description="torch.distributed collective timeout."
    )
    evict_severities: list[Severity] = Field(
        default_factory=lambda: ["critical"],
        description="Node anomaly severities that evict the node, within what the "
        "operator allows (its evictSeverities setting, default critical): a job may only "
        "narrow it. Problems the job causes itself (NaN loss, hang, straggler) never evict.",
    )
    spares: int = Field(
        0,
        ge=0,
        le=10_000,
        description=(
            "Extra worker pods kept started and registered but not training: a lost "
            "worker's place is taken by a spare in the recovery's own generation, with no "
            "pod to schedule and no cold start; a new pod then refills the spares. Each "
            "spare holds the resources of a worker."
        ),
    )


# An absolute path whose parts are neither '.' nor '..' (RE2 has no look-ahead: each part
# is spelled out). The root directory alone is refused too.
_PART = r"([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)"
STORAGE_PATH_PATTERN = rf"^(/{_PART})+/?$"


class StorageConfig(SpecModel):
    """Where persisted checkpoints go: a directory, optionally on a PersistentVolumeClaim."""

    path: str | None = Field(
        None,
        pattern=STORAGE_PATH_PATTERN,
        max_length=4096,
        description=(
            "Directory for persisted checkpoints: an absolute path, no '.' or '..' parts. On "
            "Kubernetes it must be on a volume (pvc, or one the template mounts there): "
            "otherwise checkpoints land in the pod's own filesystem and die with it."
        ),
    )
    pvc: str | None = Field(None, description="PersistentVolumeClaim mounted for checkpoints.")


class CheckpointConfig(SpecModel):
    """In-memory snapshots, peer replicas and persisted checkpoints."""

    interval_steps: int = Field(50, gt=0, le=1_000_000, description="Snapshot every n steps.")
    keep: int = Field(
        3,
        ge=1,
        le=10_000,
        description=(
            "Complete persisted checkpoints kept (every shard of a step, the newest taken "
            "first); older steps are deleted, the newest complete one never."
        ),
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Where persisted checkpoints are written."
    )
    peer_replication: bool = Field(True, description="Keep a replica in a peer's memory.")
    allow_fresh_start: bool = Field(
        False,
        description=(
            "Once a checkpoint was persisted, a restore that finds none (storage emptied, "
            "every copy corrupt) fails the job with a condition saying which step is "
            "missing; true lets the workers start over from step 0 instead."
        ),
    )


# The spec's cross-field rules the API server checks too (CEL over the whole spec); those
# that depend on the pod template's GPUs or on the shard-group arithmetic are the
# operator's alone (it fails such a job with Valid=False and the same message).
_MIN_WORKERS = "must be <= workers"
_MAX_FAILURES = "must be < workers"
_PIPELINE_WORKERS = (
    "maxFailures + 1 pipelines of >= minStages stages need (maxFailures + 1) x minStages workers"
)
_EXPERTS_NEED_MOE = (
    "expert parallelism needs a Mixture-of-Experts model: set trainer.model.moe or a -moe preset"
)
_EXPERT_REPLICAS = (
    "must be between maxFailures + 1 (so any maxFailures losses leave a replica of every "
    "expert) and workers"
)
_PIPELINE = "self.trainer.parallelism.pipeline"
_EXPERTS = "self.trainer.parallelism.experts"
_COPIES = "(self.faultTolerance.maxFailures + 1)"


class TrainingJobSpec(SpecModel):
    """The desired job: how many workers, what they train, how faults are handled."""

    workers: int = Field(
        ...,
        ge=1,
        le=100_000,
        description=(
            "Worker pods, typically one per node. Each runs processesPerWorker trainer "
            "processes (one per GPU); ranks are ordered worker by worker. maxFailures and "
            "minWorkers count worker pods."
        ),
    )
    processes_per_worker: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            "Trainer processes per worker pod, one per GPU: process i uses cuda:i. Default: "
            "the trainer container's nvidia.com/gpu count, or 1 without GPUs. When the "
            "container asks for GPUs this must equal their count. A pod is the unit of "
            "failure: one of its processes failing replaces the whole pod."
        ),
    )
    min_workers: int = Field(
        1, ge=1, description="Below this many live workers the job restarts from checkpoint."
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="PodTemplateSpec for the trainer container (image, resources, env).",
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="What each worker trains."
    )
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig,
        description="Faults survived in process, restarts, hang and node-anomaly handling.",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Snapshot interval, persisted checkpoints kept and where they go.",
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.minWorkers <= self.workers",
                    _MIN_WORKERS,
                    "minWorkers",
                ),
                cel(
                    "self.faultTolerance.maxFailures < self.workers",
                    _MAX_FAILURES,
                    "faultTolerance.maxFailures",
                ),
                cel(
                    f"!has({_PIPELINE}) || {_COPIES} * {_PIPELINE}.minStages <= self.workers",
                    _PIPELINE_WORKERS,
                    "trainer.parallelism.pipeline.minStages",
                ),
                cel(
                    f"!has({_EXPERTS}) || has(self.trainer.model.moe) || "
                    "self.trainer.model.family != 'gpt' || (has(self.trainer.model.preset) && "
                    "self.trainer.model.preset.endsWith('-moe'))",
                    _EXPERTS_NEED_MOE,
                    "trainer.parallelism.experts",
                ),
                cel(
                    f"!has({_EXPERTS}) || has({_PIPELINE}) || !has({_EXPERTS}.minReplicas) || "
                    f"({_COPIES} <= {_EXPERTS}.minReplicas && "
                    f"{_EXPERTS}.minReplicas <= self.workers)",
                    _EXPERT_REPLICAS,
                    "trainer.parallelism.experts.minReplicas",
                ),
            ]
        },
    )

    @property
    def worker_slots(self) -> int:
        """Worker pods the job runs: ``workers`` that train plus the spares."""
        return self.workers + self.fault_tolerance.spares

    @property
    def trainer_processes(self) -> int:
        """Trainer processes per worker pod: processesPerWorker, else one per GPU, else 1."""
        return self.processes_per_worker or trainer_gpus(self.template) or 1

    def worker_wire(self) -> dict[str, Any]:
        """The spec as every driver hands it to its workers (``JOB_SPEC_ENV``): without the
        pod template, which the worker runs in already (a user's template is often
        kilobytes, and a pod's every byte is stored, sent to every watcher and decoded once
        per pod event), and with the trainer processes per pod explicit, since they may
        come from the template's GPU count."""
        wire = {**self.wire(), "processesPerWorker": self.trainer_processes}
        wire.pop("template", None)
        return wire

    @model_validator(mode="after")
    def _cross_field(self) -> TrainingJobSpec:
        if self.min_workers > self.workers:
            raise _rule(
                "minWorkers",
                _MIN_WORKERS,
                {"workers": self.workers, "minWorkers": self.min_workers},
            )
        f = self.fault_tolerance.max_failures
        if f >= self.workers:
            got = {"workers": self.workers, "maxFailures": f}
            raise _rule("faultTolerance.maxFailures", _MAX_FAILURES, got)
        gpus = trainer_gpus(self.template)
        g = self.processes_per_worker
        if g is not None and gpus and g != gpus:
            raise _rule(
                "processesPerWorker",
                "must equal the trainer container's nvidia.com/gpu count ({gpus}: one process "
                "per GPU), got {g}",
                gpus=gpus,
                g=g,
            )
        g = self.trainer_processes
        within_pipelines = self.trainer.parallelism.pipeline is not None
        if g > 1 and self.trainer.parallelism.experts is not None and not within_pipelines:
            raise _rule(
                "trainer.parallelism.experts",
                "is not supported yet with {g} trainer processes per worker pod without "
                "pipelines (it places state per process, not per pod): use processesPerWorker "
                "1, or pipelines (each stage spreads its experts over its pod's processes)",
                g=g,
            )
        experts = self.trainer.parallelism.experts
        if experts is not None:
            self._check_experts(experts, f)
        pipeline = self.trainer.parallelism.pipeline
        if pipeline is not None:
            self._check_pipeline_processes(g)
        if pipeline is not None and (f + 1) * pipeline.min_stages > self.workers:
            raise _rule(
                "trainer.parallelism.pipeline.minStages",
                _PIPELINE_WORKERS,
                {"maxFailures": f, "minStages": pipeline.min_stages, "workers": self.workers},
            )
        zero = self.trainer.parallelism.zero
        if zero.stage > 0:
            # Under pipelines a stage is sharded over its pod's processes (the pipelines
            # are the copies); otherwise shard groups keep maxFailures + 1 replicas.
            size = g if pipeline is not None else zero_shard_group_size(self.workers, f, g)
            if size < 2:
                raise _rule(
                    "trainer.parallelism.zero.stage",
                    "ZeRO needs shard groups of >= 2 processes, but {w} workers kept in "
                    "maxFailures + 1 = {r} replicas leave groups of 1 (use more workers, "
                    "a lower maxFailures, or stage 0)",
                    w=self.workers,
                    r=f + 1,
                )
            h = zero.hpz_partition_size
            if h > 1 and (size % h or h >= size):
                raise _rule(
                    "trainer.parallelism.zero.hpzPartitionSize",
                    "must divide and be smaller than the shard group size {s} ({w} workers, "
                    "maxFailures + 1 = {r} replicas; equal would be plain ZeRO-3), got {h}",
                    s=size,
                    w=self.workers,
                    r=f + 1,
                    h=zero.hpz_partition_size,
                )
        return self

    def _check_pipeline_processes(self, g: int) -> None:
        """Pipelines over pods of g processes: every micro-batch splits evenly over them."""
        zero = self.trainer.parallelism.zero
        if zero.stage > 0 and g == 1:
            raise _rule(
                "trainer.parallelism.zero.stage",
                "ZeRO under pipelines shards each stage over its worker pod's processes; "
                "with one process per pod there is nothing to shard over (set "
                "processesPerWorker, one process per GPU, or use stage 0), got stage {s}",
                s=zero.stage,
            )
        batch = self.trainer.batch
        uneven = batch.micro_batch_size % g or batch.global_batch_size % batch.micro_batch_size
        if g > 1 and uneven:
            raise _rule(
                "trainer.batch.microBatchSize",
                "with pipelines over pods of {g} processes each micro-batch is split evenly "
                "over them: microBatchSize must be a multiple of {g} and divide "
                "globalBatchSize ({gb}), got {m}",
                g=g,
                gb=batch.global_batch_size,
                m=batch.micro_batch_size,
            )

    def _check_experts_in_stages(self, experts: ExpertParallelConfig) -> None:
        """Experts under pipelines: spread over a stage pod's processes, replicated by the
        pipelines (a pod is the unit of failure, so replicas inside one buy load balance,
        not survival)."""
        g = self.trainer_processes
        if g < 2:
            raise _rule(
                "trainer.parallelism.experts",
                "under pipelines experts are spread over the processes of a stage's worker "
                "pod: needs processesPerWorker >= 2 (one process per GPU), got {g}",
                g=g,
            )
        r = experts.min_replicas
        if r is not None and not 1 <= r <= g:
            raise _rule(
                "trainer.parallelism.experts.minReplicas",
                "under pipelines counts replicas among a pod's {g} processes (the pipelines "
                "give maxFailures + 1 copies): must be between 1 and {g}, got {r}",
                g=g,
                r=r,
            )
        if experts.rebalance_interval_steps:
            raise _rule(
                "trainer.parallelism.experts.rebalanceIntervalSteps",
                "is not supported under pipelines by this version of the engine (experts keep "
                "their placement); use 0, got {n}",
                n=experts.rebalance_interval_steps,
            )

    def _check_experts(self, experts: ExpertParallelConfig, max_failures: int) -> None:
        model = self.trainer.model
        # Other families' sizes (a preset, config.json) are resolved by the trainer, which
        # refuses experts for a dense model with the same field in the message.
        gpt_dense = model.family == "gpt" and not (model.preset or "").endswith("-moe")
        if model.moe is None and gpt_dense:
            raise _rule("trainer.parallelism.experts", _EXPERTS_NEED_MOE)
        if self.trainer.parallelism.pipeline is not None:
            self._check_experts_in_stages(experts)
            return
        r = experts.min_replicas
        if r is not None and not max_failures + 1 <= r <= self.workers:
            raise _rule(
                "trainer.parallelism.experts.minReplicas",
                _EXPERT_REPLICAS,
                {"maxFailures": max_failures, "workers": self.workers, "minReplicas": r},
            )


# A job's name names its headless Service, so it must be a DNS-1035 label: lower case
# letters, digits and '-', starting with a letter, at most 63 characters. The API server
# takes any DNS subdomain (253 characters, a leading digit, dots) for a TrainingJob.
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_MAX = 63
JOB_NAME_RULE = (
    f"a job name is a DNS-1035 label (it names the job's Service): lower case letters, "
    f"digits and '-', starting with a letter and ending with a letter or digit, at most "
    f"{JOB_NAME_MAX} characters"
)


def job_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a TrainingJob, or None."""
    if len(name) > JOB_NAME_MAX or not re.match(JOB_NAME_PATTERN, name):
        return f"metadata.name {name[:80]!r}: {JOB_NAME_RULE}"
    return None


class ObjectMeta(BaseModel):
    """The part of Kubernetes ObjectMeta a manifest author writes."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(..., min_length=1)

    @field_validator("name")
    @classmethod
    def _job_name(cls, value: str) -> str:
        if job_name_problem(value) is not None:
            raise PydanticCustomError("job_name", JOB_NAME_RULE)
        return value

    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class TrainingJob(BaseModel):
    """A whole TrainingJob manifest."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["bulkhead.dev/v1alpha1"] = Field(..., alias="apiVersion")
    kind: Literal["TrainingJob"]
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: dict[str, Any] | None = None
