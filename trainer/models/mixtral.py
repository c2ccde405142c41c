"""The ``mixtral`` family: Llama blocks whose feed-forwards are top-k routed SwiGLU experts.

Routing as Mixtral does it: a softmax over every expert's router logit, the ``top_k``
largest probabilities kept and renormalised to sum to one. The auxiliary loss is the
Switch-Transformer load-balancing term exactly as Hugging Face's
``load_balancing_loss_func`` computes it: the router decisions of all MoE layers pooled,
``E * sum_e (routed slots of e / rows) * (sum of e's probabilities / rows)`` where a row
is one token at one layer (``top_k`` when routing is uniform). The layers are ``pooled``:
each returns its statistics (slot counts, probability sums, rows), the model sums them
and takes the loss of the sum, so a pipeline can add its stages' statistics up.

Parameter names follow Hugging Face's per-expert Mixtral layout:
``model.layers.N.block_sparse_moe.gate.weight`` and
``model.layers.N.block_sparse_moe.experts.E.w1|w2|w3.weight`` (w1: gate, w3: up, w2: down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bulkhead.trainer.models.hf_config import MIXTRAL
from bulkhead.trainer.models.llama import Llama
from bulkhead.trainer.models.protocol import ModelFamily, MoELayer, Routing
from bulkhead.trainer.models.sizes import LlamaSizes

__all__ = ["FAMILY", "Mixtral", "MixtralExpert", "MixtralMoE"]


class MixtralExpert(nn.Module):
    """One SwiGLU expert: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, d_model, bias=False)
        self.w3 = nn.Linear(d_model, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralMoE(MoELayer):
    """Mixtral's sparse feed-forward: the router is Hugging Face's ``gate``."""

    def __init__(self, sizes: LlamaSizes) -> None:
        super().__init__()
        assert sizes.moe is not None
        if not 1 <= sizes.moe.top_k <= sizes.moe.num_experts:
            raise ValueError(
                f"spec.trainer.model.moe.topK: must be in [1, {sizes.moe.num_experts}], "
                f"got {sizes.moe.top_k}"
            )
        self.num_experts = sizes.moe.num_experts
        self.top_k = sizes.moe.top_k
        self.d_model, self.ffn_dim = sizes.d_model, sizes.ffn_dim
        self.gate = nn.Linear(sizes.d_model, self.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): self.new_expert() for e in range(self.num_experts)})

    @property
    def router(self) -> nn.Module:  # type: ignore[override]
        return self.gate

    def new_expert(self) -> nn.Module:
        return MixtralExpert(self.d_model, self.ffn_dim)

    def route(self, tokens: torch.Tensor) -> Routing:
        probs = F.softmax(self.gate(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(probs=probs, weights=weights.to(tokens.dtype), chosen=chosen)

    pooled = True

    @property
    def stats_size(self) -> int:
        return 2 * self.num_experts + 1

    def balance_stats(self, routing: Routing) -> torch.Tensor:
        """``[slots routed to each expert, sum of each expert's probability, rows]``."""
        probs = routing.probs.float()
        counts = torch.bincount(routing.chosen.reshape(-1), minlength=self.num_experts)
        rows = probs.new_full((1,), probs.shape[0])
        return torch.cat((counts.to(probs.dtype), probs.sum(dim=0), rows))

    def pooled_loss(self, stats: torch.Tensor) -> torch.Tensor:
        e = self.num_experts
        rows = stats[-1].clamp_min(1.0)  # no rows: counts and sums are zero, so is the loss
        return e * torch.sum(stats[:e] * stats[e : 2 * e]) / (rows * rows)

    def aux_loss(self, routing: Routing) -> torch.Tensor:
        """The loss of this one layer's routing."""
        return self.pooled_loss(self.balance_stats(routing))


class Mixtral(Llama):
    family = "mixtral"
    moe_class = MixtralMoE


def _sizes(model_config: object) -> LlamaSizes:
    from bulkhead.trainer.models.spec_sizes import resolve

    return resolve(model_config, "mixtral")  # type: ignore[arg-type]


FAMILY = ModelFamily(
    name="mixtral",
    sizes=_sizes,
    build=Mixtral,
    hf=MIXTRAL,
    description="Mixtral: Llama blocks with top-k softmax-routed SwiGLU experts",
)
