"""A model family defined outside bulkhead, as a user would write one.

Deliberately unlike ``gpt``: no positional embedding, RMS norms without bias, bias-free
projections, a head *not* tied to the embedding, and other module names (``embed``,
``layers.<i>``, ``norm``, ``lm_head``). The engine must train it knowing only the
protocol. Registered by ``module:attribute`` (``toy_family:FAMILY``) in the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.models.protocol import CausalLM, ModelFamily, ModelOutput, MoELayer


@dataclass(frozen=True)
class ToySizes:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    moe: None = None


def toy_sizes(model: ModelConfig) -> ToySizes:
    if model.preset is not None:
        raise ValueError("spec.trainer.model.preset: the toy family has no presets")
    return ToySizes(model.vocab_size, model.d_model, model.n_layers, model.n_heads, model.seq_len)


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Layer(nn.Module):
    def __init__(self, sizes: ToySizes) -> None:
        super().__init__()
        d = sizes.d_model
        self.heads = sizes.n_heads
        self.norm1 = RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.norm2 = RMSNorm(d)
        self.w_in = nn.Linear(d, 2 * d, bias=False)
        self.w_out = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        return x + self.w_out(F.silu(self.w_in(self.norm2(x))))


class ToyLM(CausalLM):
    family = "toy"

    def __init__(self, sizes: ToySizes) -> None:
        super().__init__()
        self.embed = nn.Embedding(sizes.vocab_size, sizes.d_model)
        self.layers = nn.ModuleList(Layer(sizes) for _ in range(sizes.n_layers))
        self.norm = RMSNorm(sizes.d_model)
        self.lm_head = nn.Linear(sizes.d_model, sizes.vocab_size, bias=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def unit_modules(self, unit: int) -> list[nn.Module]:
        n = len(self.layers)
        if unit == 0:
            return [self.embed]
        return [self.layers[unit - 1]] if unit <= n else [self.norm, self.lm_head]

    def unit_of(self, param: str) -> int:
        if param.startswith("embed."):
            return 0
        if param.startswith("layers."):
            return int(param.split(".")[1]) + 1
        return len(self.layers) + 1

    def moe_layers(self) -> dict[int, MoELayer]:
        return {}

    def moe_path(self, block: int) -> str:
        raise KeyError(f"block {block} has no MoE layer")

    def decays(self, param: str, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2 and not param.startswith("embed.")

    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("scale"):
                nn.init.ones_(p)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        units: tuple[int, int] | None = None,
    ) -> ModelOutput:
        n = len(self.layers)
        start, stop = units if units is not None else (0, n + 2)
        x = self.embed(tokens) if start == 0 else tokens
        for layer in self.layers[max(start, 1) - 1 : min(stop, n + 1) - 1]:
            x = layer(x)
        zero = x.new_zeros(())
        if stop <= n + 1:
            return ModelOutput(x, None, zero)
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ModelOutput(logits, loss, zero)


FAMILY = ModelFamily(name="toy", sizes=toy_sizes, build=ToyLM, description="a test's own model")
