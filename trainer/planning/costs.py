"""Layer cost model: per-layer time and memory that the planners optimise over.

A plan layer is one unit a pipeline stage can hold: the embedding, each decoder block, and
the output head. ``estimate_layer_costs`` derives the costs analytically from the model's shape
(its units' parameter counts, measured through the model-family protocol) and a
``GpuSpec``; ``bulkhead.trainer.planning.profile`` measures them on real modules
instead. Both produce the same ``LayerCost`` records, so the planners do not care which.

Memory follows what the trainer allocates (``trainer.engine.precision``) in either
precision: the parameters the optimizer updates are fp32 (4 bytes, the master weights),
gradients are fp32 (4, reduced in fp32) and AdamW keeps two fp32 moments (8): 16 bytes per
parameter, split 4 / 4 / 8 (not the ZeRO paper's 2 / 2 / 12 of a separate bf16 copy: under
bf16 only FSDP2's transiently gathered parameters are bf16).

Activations (``activation_bytes``: what autograd keeps for backward per micro-batch of b
sequences of s tokens). A family counts what one token of each unit keeps, by dtype
(``ActivationValues`` from ``CausalLM.activation_values``): under bf16 autocast the
residual stream, norm statistics, the attention's log-sum-exp and the routing stay fp32,
the rest is bf16, an input several projections read is cast once per projection, and
autocast keeps a bf16 copy of every weight a unit multiplies by (+2 bytes per parameter).
A family that declares nothing gets Korthikanti et al.'s 34*s*b*h bytes per decoder
block for 2-byte values (doubled in fp32, +4*s*b*h of fp32 norms under bf16) without
their attention-score term (``scaled_dot_product_attention`` keeps no score matrix). A
recomputed block (``activationCheckpointing``) keeps its input alone. Where FSDP2 gathers
a unit's weights in bf16 (ZeRO) autocast copies and casts nothing and the norms' outputs
are bf16 (``gathered``); ``parallel.rank_memory`` says which units that is on which rank,
and what each rank of a layout holds. Measured against
the trainer (``bench/precision.py``): gpt, llama and mixtral within 2 % in fp32 and bf16,
with and without checkpointing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PARAM_BYTES = 4  # fp32 master weights (the optimizer's parameters), in either precision
GRAD_BYTES = 4  # fp32 gradients (reduced in fp32)
OPTIMIZER_BYTES = 8  # AdamW's two fp32 moments
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}  # bytes per activation value, by trainer.precision
CHECKPOINTING = ("none", "full", "selective")  # trainer.activationCheckpointing


def recomputed_blocks(num_blocks: int, mode: str) -> list[int]:
    """The blocks (0-based) activation checkpointing ``mode`` recomputes: none, every one
    (full), or every other one, the first included (selective)."""
    if mode not in CHECKPOINTING:
        raise ValueError(
            f"spec.trainer.activationCheckpointing: must be one of {CHECKPOINTING}, got {mode!r}"
        )
    if mode == "full":
        return list(range(num_blocks))
    if mode == "selective":
        return list(range(0, num_blocks, 2))
    return []


@dataclass(frozen=True)
class LayerCost:
    """Cost of one plan layer for one micro-batch on one GPU."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def state_bytes(self) -> int:
        """Persistent bytes (parameters, gradients, optimizer state), before sharding."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuSpec:
    """What the planner needs to know about one node's GPUs."""

    gpus_per_node: int = 8
    memory_bytes: int = 80 * 2**30
    peak_flops: float = 989e12  # dense bf16, H100 SXM
    efficiency: float = 0.4  # achieved fraction of peak (model FLOPs utilisation)
    intra_node_bandwidth: float = 300e9  # bytes/s per GPU (NVLink)
    collective_latency_s: float = 20e-6
    memory_headroom: float = 0.9  # fraction of memory the plan may use (allocator, buffers)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.memory_bytes <= 0 or self.peak_flops <= 0 or self.intra_node_bandwidth <= 0:
            raise ValueError("memory_bytes, peak_flops and intra_node_bandwidth must be > 0")
        if not 0 < self.efficiency <= 1 or not 0 < self.memory_headroom <= 1:
            raise ValueError("efficiency and memory_headroom must be in (0, 1]")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.memory_headroom

    def allreduce_s(self, nbytes: float, gpus: int) -> float:
        """Ring all-reduce of ``nbytes`` among ``gpus`` GPUs of one node."""
        if gpus <= 1:
            return 0.0
        return 2 * (gpus - 1) / gpus * nbytes / self.intra_node_bandwidth + (
            self.collective_latency_s
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _layer(name: str, params: float, flops_fwd: float, act: float, gpu: GpuSpec) -> LayerCost:
    forward = flops_fwd / (gpu.peak_flops * gpu.efficiency)
    n = int(params)
    return LayerCost(
        name=name,
        forward_s=forward,
        backward_s=2 * forward,  # weight and input gradients: two matmuls per forward matmul
        param_bytes=n * PARAM_BYTES,
        grad_bytes=n * GRAD_BYTES,
        optimizer_bytes=n * OPTIMIZER_BYTES,
        activation_bytes=int(act),
    )


@dataclass(frozen=True)
class ActivationValues:
    """What one token of a unit keeps for backward, in values by the dtype they are kept in.

    A family declares it (``CausalLM.activation_values``), counted from what its modules
    save; the planner turns it into bytes for the job's precision.
    """

    fp32: float = 0.0  # fp32 in either precision: residual stream, norm statistics, routing
    compute: float = 0.0  # in the compute dtype: 2 bytes under bf16, 4 in fp32
    bf16_casts: float = 0.0  # bf16 only: more copies of an input several projections cast
    int64: float = 0.0  # indices: token ids, routing choices
    # Of ``fp32``: the norms' normalised outputs, which are bf16 where FSDP2 gathers the
    # weights in bf16 (a bf16 norm weight multiplies them in bf16).
    norm_outputs: float = 0.0

    def bytes_per_token(self, precision: str, gathered: bool = False) -> float:
        """Bytes per token under ``precision``; ``gathered``: the unit's weights are
        FSDP2's bf16 gathers (no autocast casts: the projections' inputs are bf16)."""
        if precision == "bf16" and gathered:
            fp32, compute = self.fp32 - self.norm_outputs, self.compute + self.norm_outputs
            return 4 * fp32 + 2 * compute + 8 * self.int64
        casts = 2 * self.bf16_casts if precision == "bf16" else 0.0
        return 4 * self.fp32 + ACTIVATION_BYTES[precision] * self.compute + casts + 8 * self.int64


@dataclass(frozen=True)
class UnitShape:
    """One unit of a model as the planners see it (``trainer.models.protocol.model_shape``
    measures it through the model-family protocol)."""

    name: str
    params: int  # parameters the unit holds (a tied tensor counted in every unit using it)
    active_params: int  # parameters one token's forward multiplies through (top-k experts)
    kind: str  # "embedding" | "block" | "head"
    # What a token keeps for backward, as the family counts it (None: the generic
    # decoder-block estimate of the module docstring).
    activations: ActivationValues | None = None


@dataclass(frozen=True)
class ModelShape:
    """What the planners know of a model: its units in order and the dimensions that set
    attention and activation costs. Pure data, so planning stays free of torch."""

    units: tuple[UnitShape, ...]
    d_model: int
    seq_len: int
    n_heads: int
    vocab_size: int
    moe_blocks: tuple[int, ...] = ()  # 0-based blocks with an MoE layer
    num_experts: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.units) - 2


def activation_bytes(
    model: ModelShape,
    unit: UnitShape,
    tokens: int,
    precision: str,
    recomputed: bool = False,
    copied_params: int | None = None,
    gathered: bool = False,
) -> int:
    """Bytes ``unit`` keeps for backward over ``tokens`` tokens (see the module docstring).
    ``copied_params``: how many of its parameters autocast copies to bf16 (default all it
    multiplies by; fewer under expert parallelism); ``gathered``: FSDP2 gathers its
    weights in the compute dtype (no copies; ``parallel.rank_memory`` says where)."""
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision must be one of {sorted(ACTIVATION_BYTES)}, got {precision!r}")
    element = ACTIVATION_BYTES[precision]
    d = model.d_model
    if recomputed and unit.kind == "block":
        return tokens * d * 4  # the block's input (the fp32 residual stream)
    # Autocast keeps a bf16 copy of every weight a unit multiplies by (an embedding gathers).
    copied = unit.params if copied_params is None else copied_params
    multiplies = unit.kind != "embedding" and not gathered
    weight_copies = 2 * copied if precision == "bf16" and multiplies else 0
    if unit.activations is not None:
        per_token = unit.activations.bytes_per_token(precision, gathered)
        return int(tokens * per_token) + weight_copies
    if unit.kind == "embedding":
        return tokens * 8  # the int64 token ids
    if unit.kind == "head":  # fp32 log-probabilities, the norm's and the projection's inputs
        return tokens * model.vocab_size * 4 + tokens * d * (4 + element) + weight_copies
    fp32_norms = tokens * d * 4 if precision == "bf16" else 0
    return tokens * d * 17 * element + fp32_norms + weight_copies


def estimate_layer_costs(
    model: ModelShape,
    gpu: GpuSpec,
    micro_batch_size: int = 1,
    precision: str = "fp32",
    checkpointing: str = "none",
) -> list[LayerCost]:
    """Analytic per-unit costs: embedding, every decoder block, head, for
    ``precision`` (``spec.trainer.precision``) and ``checkpointing``
    (``spec.trainer.activationCheckpointing``).

    Forward FLOPs are 2 per multiply-accumulate of every weight a token touches (an MoE
    block's ``top_k`` active experts; every expert counts for memory), plus a block's
    attention score and value products; the embedding is a gather (one pass over the
    hidden state).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    d, s = model.d_model, model.seq_len
    tokens = micro_batch_size * s
    recomputed = set(recomputed_blocks(model.n_layers, checkpointing))
    layers = []
    for i, unit in enumerate(model.units):
        act = activation_bytes(model, unit, tokens, precision, (i - 1) in recomputed)
        if unit.kind == "embedding":
            flops = 2 * tokens * d
        elif unit.kind == "head":
            flops = 2 * tokens * unit.active_params
        else:  # projections and MLP or experts, plus QK^T and AV
            flops = 2 * tokens * unit.active_params + 2 * 2 * tokens * s * d
        layers.append(_layer(unit.name, unit.params, flops, act, gpu))
    return layers
