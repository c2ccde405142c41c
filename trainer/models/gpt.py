"""The ``gpt`` family: a GPT-2-style byte-level decoder whose feed-forwards can be MoE.

Pre-norm blocks (LayerNorm, biased causal multi-head attention, GELU MLP), learned
positions, the head tied to the token embedding. Every ``moe.every``-th block's
feed-forward is ``GPTMoE``: top-k softmax routing over GELU experts with the Switch
Transformer balance loss ``E * sum_i f_i * P_i`` (f_i: share of routed slots that went to
expert i, P_i: mean router probability of expert i; 1 when routing is uniform).

Units (see ``protocol``): 0 = ``tok_emb`` + ``pos_emb``, ``1..n`` = ``blocks.i``, ``n + 1``
= ``ln_f`` + ``head`` (whose weight is ``tok_emb.weight``: the tied group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.config import ModelSizes, resolve_model
from bulkhead.trainer.models.protocol import (
    CausalLM,
    ModelFamily,
    ModelOutput,
    MoELayer,
    Routing,
    routed_values,
)
from bulkhead.trainer.planning.costs import ActivationValues


class Expert(nn.Module):
    """One feed-forward expert (the same shape as a dense block's MLP)."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, ffn_dim)
        self.down = nn.Linear(ffn_dim, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class GPTMoE(MoELayer):
    """Top-k routed GELU experts; ``forward`` returns (output, balance loss)."""

    def __init__(
        self, d_model: int, ffn_dim: int, num_experts: int, top_k: int, dropout: float
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self._shape = (d_model, ffn_dim, dropout)
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): self.new_expert() for e in range(num_experts)})

    def new_expert(self) -> nn.Module:
        return Expert(*self._shape)

    def route(self, tokens: torch.Tensor) -> Routing:
        probs = F.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        return Routing(probs, weights / weights.sum(dim=-1, keepdim=True), chosen)

    def aux_loss(self, routing: Routing) -> torch.Tensor:
        """Switch-style balance loss: minimal (1.0) for uniform routing."""
        chosen, probs = routing.chosen, routing.probs
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).to(probs.dtype)
        dispatch_share = counts / chosen.numel()
        return self.num_experts * torch.sum(dispatch_share * probs.mean(dim=0))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm decoder block; the feed-forward is dense or Mixture-of-Experts."""

    def __init__(self, sizes: ModelSizes, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(sizes.d_model)
        self.attn = CausalSelfAttention(sizes.d_model, sizes.n_heads, sizes.dropout)
        self.ln2 = nn.LayerNorm(sizes.d_model)
        self.ffn: nn.Module
        if moe:
            assert sizes.moe is not None
            self.ffn = GPTMoE(
                sizes.d_model, sizes.ffn_dim, sizes.moe.num_experts, sizes.moe.top_k, sizes.dropout
            )
        else:
            self.ffn = Expert(sizes.d_model, sizes.ffn_dim, sizes.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        if isinstance(self.ffn, MoELayer):
            y, aux = self.ffn(self.ln2(x))
        else:
            y, aux = self.ffn(self.ln2(x)), x.new_zeros(())
        return x + y, aux


class GPT(CausalLM):
    family = "gpt"
    tied = (("tok_emb.weight", "head.weight"),)

    def __init__(self, sizes: ModelSizes) -> None:
        super().__init__()
        self.sizes = sizes
        self.tok_emb = nn.Embedding(sizes.vocab_size, sizes.d_model)
        self.pos_emb = nn.Embedding(sizes.seq_len, sizes.d_model)
        self.drop = nn.Dropout(sizes.dropout)
        # Registered as ``blocks`` directly (the protocol's property of that name reads
        # it): parameter names are ``blocks.<i>...``.
        self._modules["blocks"] = nn.ModuleList(
            Block(sizes, sizes.is_moe_block(i)) for i in range(sizes.n_layers)
        )
        self.ln_f = nn.LayerNorm(sizes.d_model)
        self.head = nn.Linear(sizes.d_model, sizes.vocab_size, bias=False)
        self.retie()  # tied embeddings, as in GPT-2

    @property
    def blocks(self) -> nn.ModuleList:  # type: ignore[override]
        return self._modules["blocks"]  # type: ignore[return-value]

    def unit_modules(self, unit: int) -> list[nn.Module]:
        n = len(self.blocks)
        if unit == 0:
            return [self.tok_emb, self.pos_emb]
        if unit <= n:
            return [self.blocks[unit - 1]]
        return [self.ln_f, self.tok_emb, self.head]  # the head's weight is the embedding's

    def unit_of(self, param: str) -> int:
        if param.startswith(("tok_emb.", "pos_emb.")):
            return 0
        if param.startswith("blocks."):
            return int(param.split(".")[1]) + 1
        return len(self.blocks) + 1  # ln_f, head

    def moe_layers(self) -> dict[int, MoELayer]:
        return {i: b.ffn for i, b in enumerate(self.blocks) if isinstance(b.ffn, MoELayer)}

    def moe_path(self, block: int) -> str:
        return f"blocks.{block}.ffn"

    def activation_values(self, unit: int) -> ActivationValues:
        s, n = self.sizes, len(self.blocks)
        d, f = s.d_model, s.ffn_dim
        if unit == 0:
            return ActivationValues(int64=1)  # the token ids
        if unit == n + 1:  # ln_f's input and statistics, fp32 log-probabilities; the head's input
            return ActivationValues(fp32=d + 2 + s.vocab_size, compute=d)
        # Both LayerNorms' inputs and statistics and the attention's log-sum-exp stay fp32;
        # the normalised inputs, q, k, v (3d) and the attention output are compute values.
        fp32, compute = 2 * d + 4 + s.n_heads, 6 * d
        moe = self.blocks[unit - 1].ffn
        if not isinstance(moe, MoELayer):
            return ActivationValues(fp32=fp32, compute=compute + 2 * f)  # GELU's input, output
        return routed_values(fp32, compute, moe, d, expert_values=2 * f + d, expert_casts=d)

    def decays(self, param: str, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2 and not param.startswith(("tok_emb.", "pos_emb.", "head."))

    def retie(self) -> None:
        self.head.weight = self.tok_emb.weight

    def init_weights(self) -> None:
        self.apply(_init_weights)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        units: tuple[int, int] | None = None,
    ) -> ModelOutput:
        """``tokens``: token ids, or the hidden states entering unit ``units[0]`` > 0.
        Unless the last unit runs, ``logits`` are the hidden states leaving the stage."""
        n = len(self.blocks)
        start, stop = units if units is not None else (0, n + 2)
        x = tokens
        if start == 0:
            t = tokens.shape[1]
            if t > self.sizes.seq_len:
                raise ValueError(
                    f"sequence of {t} tokens is longer than seq_len {self.sizes.seq_len}"
                )
            pos = torch.arange(t, device=tokens.device)
            x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        aux = x.new_zeros(())
        for block in self.blocks[max(start, 1) - 1 : min(stop, n + 1) - 1]:
            x, block_aux = block(x)
            aux = aux + block_aux
        if stop <= n + 1:
            return ModelOutput(logits=x, lm_loss=None, aux_loss=aux)
        logits = self.head(self.ln_f(x))
        lm_loss = None
        if targets is not None:
            # In fp32 whatever the compute precision (bf16 logits lose the loss's digits).
            lm_loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
            )
        return ModelOutput(logits=logits, lm_loss=lm_loss, aux_loss=aux)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


# ModelConfig fields of the llama/mixtral families that the GPT decoder has no use for.
_NOT_GPT = {
    "n_kv_heads": "nKvHeads",
    "rope_theta": "ropeTheta",
    "rope_scaling": "ropeScaling",
    "rms_norm_eps": "rmsNormEps",
    "tie_embeddings": "tieEmbeddings",
    "pretrained": "pretrained",
}


def gpt_sizes(model: ModelConfig) -> ModelSizes:
    """The gpt family's sizes of ``spec.trainer.model``; a setting only the llama and mixtral
    families honour is an error naming it (never silently ignored)."""
    given = model.given()
    for name, wire in _NOT_GPT.items():
        if name in given:
            raise ValueError(
                f"spec.trainer.model.{wire}: the gpt family has no such setting "
                "(family llama or mixtral has)"
            )
    return resolve_model(model)


FAMILY = ModelFamily(
    name="gpt",
    sizes=gpt_sizes,
    build=GPT,
    description="GPT-2-style byte-level decoder (learned positions, LayerNorm, tied head, "
    "optional GELU experts)",
)
