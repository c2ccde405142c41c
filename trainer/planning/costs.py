"""Layer cost model: per-layer time and memory that the planners optimise over.

A plan layer is one unit a pipeline stage can hold: the embedding, each decoder block, and
the output head. ``estimate_layer_costs`` derives the costs analytically from the job's model
config and a ``GpuSpec``; ``bulkhead.trainer.planning.profile`` measures them on real modules
instead. Both produce the same ``LayerCost`` records, so the planners do not care which.

Memory follows mixed-precision Adam (the ZeRO paper's K = 12): 2 bytes of bf16 parameters,
2 of gradients and 12 of fp32 master weights plus two moments per parameter. Activation
bytes per micro-batch follow Korthikanti et al. (s*b*h*(34 + 5*a*s/h) per decoder block,
bf16, no recomputation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.config import ModelSizes

PARAM_BYTES = 2  # bf16 weights
GRAD_BYTES = 2  # bf16 gradients
OPTIMIZER_BYTES = 12  # fp32 master + Adam m and v


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


def estimate_layer_costs(
    model: ModelConfig | ModelSizes, gpu: GpuSpec, micro_batch_size: int = 1
) -> list[LayerCost]:
    """Analytic per-layer costs: embedding, ``model.n_layers`` decoder blocks, head.

    Pass resolved sizes (``bulkhead.trainer.config.resolve_model``) when a preset is used.

    Forward FLOPs are 2 per multiply-accumulate of every weight a token touches, plus the
    attention score and value products; an MoE block counts only its ``top_k`` active experts
    for time but all experts for memory.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    d, s, heads = model.d_model, model.seq_len, model.n_heads
    ffn = model.ffn_dim or 4 * d
    tokens = micro_batch_size * s
    attn_params = 4 * d * d + 4 * d  # qkv + output projection, two norms
    mlp_params = 2 * d * ffn
    attn_flops = 2 * tokens * 4 * d * d + 2 * 2 * tokens * s * d  # projections + QK^T, AV
    block_act = s * micro_batch_size * d * (34 + 5 * heads * s / d)

    layers = [
        _layer(
            "embedding",
            params=model.vocab_size * d + s * d,
            flops_fwd=2 * tokens * d,  # a gather; counted as one pass over the hidden state
            act=tokens * d * PARAM_BYTES,
            gpu=gpu,
        )
    ]
    moe = model.moe
    for i in range(model.n_layers):
        is_moe = moe is not None and (i + 1) % moe.every == 0
        if is_moe:
            assert moe is not None
            params = attn_params + moe.num_experts * mlp_params + d * moe.num_experts
            flops = attn_flops + 2 * tokens * (moe.top_k * mlp_params + d * moe.num_experts)
            act = block_act + tokens * moe.top_k * ffn * PARAM_BYTES
            layers.append(_layer(f"block{i}.moe", params, flops, act, gpu))
        else:
            flops = attn_flops + 2 * tokens * mlp_params
            layers.append(_layer(f"block{i}", attn_params + mlp_params, flops, block_act, gpu))
    layers.append(
        _layer(
            "head",
            params=model.vocab_size * d + 2 * d,
            flops_fwd=2 * tokens * d * model.vocab_size,
            act=tokens * model.vocab_size * 4,  # fp32 logits for the loss
            gpu=gpu,
        )
    )
    return layers


def total_state_bytes(layers: Sequence[LayerCost]) -> int:
    return sum(layer.state_bytes for layer in layers)
