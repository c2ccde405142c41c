"""Mixture-of-Experts feed-forward: top-k token routing with a load-balancing loss.

The router picks ``top_k`` experts per token; their outputs are mixed with the renormalised
router probabilities. The auxiliary loss is the Switch Transformer balance term
``E * sum_i f_i * P_i`` (f_i: share of routed slots that went to expert i, P_i: mean router
probability of expert i); it is 1 when routing is perfectly uniform.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One feed-forward expert (the same shape as a dense block's MLP)."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, ffn_dim)
        self.down = nn.Linear(ffn_dim, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class MoEFeedForward(nn.Module):
    """Top-k routed experts; ``forward`` returns (output, load-balancing loss)."""

    def __init__(
        self, d_model: int, ffn_dim: int, num_experts: int, top_k: int, dropout: float
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, ffn_dim, dropout) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            # Every expert runs, on no tokens if none chose it: its gradient is then zero
            # rather than missing, so sharded and replicated gradient reductions line up.
            token_idx, slot = (chosen == e).nonzero(as_tuple=True)
            contribution = expert(tokens[token_idx]) * weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, contribution)
        return out.reshape(shape), self.balance_loss(probs, chosen)

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch-style auxiliary loss: minimal (1.0) for uniform routing."""
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).to(probs.dtype)
        dispatch_share = counts / chosen.numel()
        mean_prob = probs.mean(dim=0)
        return self.num_experts * torch.sum(dispatch_share * mean_prob)
