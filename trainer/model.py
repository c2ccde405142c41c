"""A GPT-style decoder (pre-norm, causal attention) whose feed-forwards can be MoE.

``GPT(sizes)(tokens, targets)`` returns a ``ModelOutput`` with the logits, the language
model loss (mean cross-entropy over the batch's tokens) and the summed MoE balance loss
(zero for a dense model); ``output.total(coef)`` is what to minimise.

``units=(start, stop)`` runs only those units (0: the embeddings, 1..n: the decoder blocks,
n + 1: the final norm and the head): a pipeline stage, called through the model itself so
that FSDP2 sharding the stage gathers its parameters as for a whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bulkhead.trainer.config import ModelSizes
from bulkhead.trainer.moe import Expert, MoEFeedForward


@dataclass
class ModelOutput:
    logits: torch.Tensor
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor

    def total(self, aux_coef: float) -> torch.Tensor:
        if self.lm_loss is None:
            raise ValueError("no targets were given, so there is no loss")
        return self.lm_loss + aux_coef * self.aux_loss


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
            self.ffn = MoEFeedForward(
                sizes.d_model, sizes.ffn_dim, sizes.moe.num_experts, sizes.moe.top_k, sizes.dropout
            )
        else:
            self.ffn = Expert(sizes.d_model, sizes.ffn_dim, sizes.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        if isinstance(self.ffn, MoEFeedForward):
            y, aux = self.ffn(self.ln2(x))
        else:
            y, aux = self.ffn(self.ln2(x)), x.new_zeros(())
        return x + y, aux


class GPT(nn.Module):
    def __init__(self, sizes: ModelSizes) -> None:
        super().__init__()
        self.sizes = sizes
        self.tok_emb = nn.Embedding(sizes.vocab_size, sizes.d_model)
        self.pos_emb = nn.Embedding(sizes.seq_len, sizes.d_model)
        self.drop = nn.Dropout(sizes.dropout)
        self.blocks = nn.ModuleList(
            Block(sizes, sizes.is_moe_block(i)) for i in range(sizes.n_layers)
        )
        self.ln_f = nn.LayerNorm(sizes.d_model)
        self.head = nn.Linear(sizes.d_model, sizes.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings, as in GPT-2
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
            lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ModelOutput(logits=logits, lm_loss=lm_loss, aux_loss=aux)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def build_model(sizes: ModelSizes, seed: int, initialize: bool = True) -> GPT:
    """The model with weights a pure function of ``seed`` (every rank builds the same one).

    ``initialize=False``: the same modules with uninitialized storage, for a caller that
    overwrites every parameter (a survivor adopting state after a membership change:
    random initialization of a large model is wasted time on the recovery's path).
    """
    if not initialize:
        with torch.device("meta"):
            model = GPT(sizes)
        model = model.to_empty(device="cpu")
        model.head.weight = model.tok_emb.weight  # to_empty unties shared parameters
        return model
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(sizes)
    finally:
        torch.random.set_rng_state(generator_state)
