"""The ``mixtral`` family: Llama blocks whose feed-forwards are top-k routed SwiGLU experts.

Routing as Mixtral does it: a softmax over every expert's router logit, the ``top_k``
largest probabilities kept and renormalised to sum to one. The auxiliary loss is the
Switch-Transformer load-balancing term as Hugging Face's ``load_balancing_loss_func``
computes it for one layer: ``E * sum_e (tokens routed to e / tokens) * mean prob of e``
(``top_k`` when routing is uniform). The model's ``aux_loss`` sums it over its MoE blocks
(Hugging Face pools the layers' statistics before the product instead; the two agree for
one MoE block and differ in second order otherwise).

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

    def aux_loss(self, routing: Routing) -> torch.Tensor:
        tokens = routing.probs.shape[0]
        if tokens == 0:
            return routing.probs.new_zeros(())
        counts = torch.bincount(routing.chosen.reshape(-1), minlength=self.num_experts)
        routed_share = counts.to(routing.probs.dtype) / tokens
        return self.num_experts * torch.sum(routed_share * routing.probs.mean(dim=0))


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
