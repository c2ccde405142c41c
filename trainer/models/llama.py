"""The ``llama`` family: Llama-2/3-shaped decoders (and the blocks ``mixtral`` reuses).

Pre-norm blocks with RMSNorm, rotary position embeddings (with Llama-3 frequency scaling
and any ``rope_theta``), grouped-query attention (``n_kv_heads`` key/value heads shared by
``n_heads / n_kv_heads`` query heads each), a SwiGLU feed-forward, no biases, and a head
tied to the embedding or not. Module names equal Hugging Face's ``LlamaForCausalLM``
parameter names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ...,
``model.norm``, ``lm_head``), so importing and exporting weights is a renaming-free copy.

Units: 0 is ``model.embed_tokens``, ``1..n`` are ``model.layers``, ``n + 1`` is
``model.norm`` with ``lm_head``. The rotary tables are not parameters or buffers: they are
a function of the sizes, recomputed per device, so nothing about them is checkpointed.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from bulkhead.trainer.models.hf_config import LLAMA
from bulkhead.trainer.models.protocol import (
    CausalLM,
    ModelFamily,
    ModelOutput,
    MoELayer,
    routed_values,
)
from bulkhead.trainer.models.sizes import LlamaSizes, RopeScaling
from bulkhead.trainer.planning.costs import ActivationValues

__all__ = ["FAMILY", "Llama", "LlamaSizes", "RopeScaling"]


def rope_frequencies(sizes: LlamaSizes) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, ``[head_dim / 2]`` float32 on the CPU,
    with Llama-3 scaling applied when the sizes ask for it."""
    dim = sizes.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (sizes.rope_theta**exponents)
    scaling = sizes.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate between.
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos and signed sin tables for positions ``0..t-1``, ``[t, 1, head_dim]`` (they
    broadcast over the heads of ``[batch, t, heads, head_dim]``), cached per (device,
    dtype, t)."""

    def __init__(self, sizes: LlamaSizes) -> None:
        self.inv_freq = rope_frequencies(sizes)
        self._cache: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, ...]] = {}

    def tables(self, t: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (like.device, like.dtype, t)
        if key not in self._cache:
            inv_freq = self.inv_freq.to(like.device)
            pos = torch.arange(t, device=like.device, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()
            # The sign of rotate-half folded into the table: the first half's sines negated.
            tables = (torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))
            self._cache = {key: tuple(z[:, None, :].to(like.dtype) for z in tables)}
        cos, signed_sin = self._cache[key]
        return cos, signed_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[batch, t, heads, head_dim]``) by the position tables: Llama's
    ``x * cos + rotate_half(x) * sin``, the same products, where ``rotate_half``'s negation
    lives in ``signed_sin`` and its swap of the halves is one ``flip`` of the split last
    dimension, on the projection's contiguous layout (on a CPU about 12 % less than ``cat``
    and ``neg`` on the transposed q and k, forward and backward)."""
    head_dim = x.shape[-1]
    swapped = x.unflatten(-1, (2, head_dim // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 whatever the activation dtype, as Llama does (torch's
        # ``x * rsqrt(mean(x^2) + eps)``, the same operations in fewer autograd nodes).
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, sizes: LlamaSizes) -> None:
        super().__init__()
        hd = sizes.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = sizes.n_heads, sizes.n_kv_heads, hd
        self.q_proj = nn.Linear(sizes.d_model, sizes.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(sizes.d_model, sizes.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(sizes.d_model, sizes.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(sizes.n_heads * hd, sizes.d_model, bias=False)
        self.dropout = sizes.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Rotated in the projections' own layout, before the transposes (contiguous).
        q = apply_rotary(self.q_proj(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm block; its feed-forward is ``mlp`` (dense) or ``block_sparse_moe``."""

    def __init__(self, sizes: LlamaSizes, moe: MoELayer | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(sizes.d_model, sizes.rms_norm_eps)
        self.self_attn = Attention(sizes)
        self.post_attention_layernorm = RMSNorm(sizes.d_model, sizes.rms_norm_eps)
        if moe is None:
            self.mlp = SwiGLU(sizes.d_model, sizes.ffn_dim)
        else:
            self.block_sparse_moe = moe

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if hasattr(self, "block_sparse_moe"):
            y, aux = self.block_sparse_moe(h)
        else:
            y, aux = self.mlp(h), x.new_zeros(())
        return x + y, aux


class LlamaModel(nn.Module):
    """The decoder without the head (Hugging Face's ``model.`` prefix)."""

    def __init__(self, sizes: LlamaSizes, make_moe: type[MoELayer] | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(sizes.vocab_size, sizes.d_model)
        self.layers = nn.ModuleList(
            DecoderLayer(sizes, make_moe(sizes) if make_moe and sizes.is_moe_block(i) else None)
            for i in range(sizes.n_layers)
        )
        self.norm = RMSNorm(sizes.d_model, sizes.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Llama(CausalLM):
    """A Llama-shaped decoder; ``Mixtral`` is the same with routed feed-forwards."""

    family = "llama"
    moe_class: type[MoELayer] | None = None

    def __init__(self, sizes: LlamaSizes) -> None:
        super().__init__()
        self.sizes = sizes
        self.tied = (
            (("model.embed_tokens.weight", "lm_head.weight"),) if sizes.tie_embeddings else ()
        )
        self.rotary = Rotary(sizes)
        device = torch.empty(()).device  # the caller's default device
        # Built on meta, then given storage and initialized once by ``init_weights``: the
        # weights are the same function of the RNG whether the engine builds on meta and
        # initializes later or builds initialized (and torch's default inits are skipped).
        with torch.device("meta"):
            self.model = LlamaModel(sizes, self.moe_class)
            self.lm_head = nn.Linear(sizes.d_model, sizes.vocab_size, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
        self.retie()
        if device.type != "meta":
            self.init_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def unit_modules(self, unit: int) -> list[nn.Module]:
        n = self.sizes.n_layers
        if unit == 0:
            return [self.model.embed_tokens]
        if 1 <= unit <= n:
            return [self.model.layers[unit - 1]]
        if unit == n + 1:  # a tied head's weight is the embedding's: the unit holds it too
            tied = [self.model.embed_tokens] if self.sizes.tie_embeddings else []
            return [self.model.norm, *tied, self.lm_head]
        raise IndexError(f"unit {unit} of a model with units 0..{n + 1}")

    def unit_of(self, param: str) -> int:
        if param.startswith("model.embed_tokens."):
            return 0
        match = _LAYER.match(param)
        if match:
            return int(match.group(1)) + 1
        if param.startswith(("model.norm.", "lm_head.")):
            if self.sizes.tie_embeddings and param == "lm_head.weight":
                return 0  # the tied group's first user is the embedding
            return self.sizes.n_layers + 1
        raise KeyError(f"{param!r} is not a parameter of this {self.family} model")

    def moe_layers(self) -> dict[int, MoELayer]:
        return {
            i: layer.block_sparse_moe
            for i, layer in enumerate(self.model.layers)
            if hasattr(layer, "block_sparse_moe")
        }

    def moe_path(self, block: int) -> str:
        return f"model.layers.{block}.block_sparse_moe"

    def activation_values(self, unit: int) -> ActivationValues:
        s, n = self.sizes, self.sizes.n_layers
        d, f = s.d_model, s.ffn_dim
        q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        if unit == 0:
            return ActivationValues(int64=1)  # the token ids
        if unit == n + 1:  # the norm's input, normalised input, statistic; fp32 log-probs
            return ActivationValues(fp32=2 * d + 1 + s.vocab_size, compute=d, norm_outputs=d)
        # Each RMSNorm keeps its input and normalised input in fp32 (and a statistic), the
        # attention its log-sum-exp; the normalised inputs, the rotated q and k, v and the
        # attention output are compute values; under bf16, q, k and v each cast the input.
        # Under FSDP2's bf16 gathers the bf16 norm weights make the normalised inputs bf16.
        fp32, compute, casts = 4 * d + 2 + s.n_heads, 2 * d + 2 * q + 2 * kv, 2 * d
        layer = self.model.layers[unit - 1]
        if not hasattr(layer, "block_sparse_moe"):  # SwiGLU: gate, silu, up, product
            return ActivationValues(
                fp32=fp32, compute=compute + 4 * f, bf16_casts=casts + d, norm_outputs=2 * d
            )
        moe = layer.block_sparse_moe
        values = routed_values(fp32, compute, moe, d, expert_values=4 * f + d, expert_casts=2 * d)
        return replace(values, norm_outputs=2 * d)

    def decays(self, param: str, tensor: torch.Tensor) -> bool:
        return not (
            param.endswith(".bias") or "norm." in param or param.startswith("model.embed_tokens.")
        )

    def retie(self) -> None:
        if self.sizes.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self) -> None:
        """Normal(0, initializer_range) for every matrix, ones for the norms (as Hugging
        Face initializes Llama), in module order from the global RNG."""
        std = self.sizes.initializer_range
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear | nn.Embedding):
                    if module is self.lm_head and self.sizes.tie_embeddings:
                        continue
                    module.weight.normal_(0.0, std)
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        units: tuple[int, int] | None = None,
    ) -> ModelOutput:
        """``tokens``: token ids, or the hidden states entering unit ``units[0]`` > 0.
        Unless the last unit runs, ``logits`` are the hidden states leaving the stage."""
        n = self.sizes.n_layers
        start, stop = units if units is not None else (0, n + 2)
        x = self.model.embed_tokens(tokens) if start == 0 else tokens
        aux = x.new_zeros((), dtype=torch.float32)
        stats: torch.Tensor | None = None  # pooled MoE layers' summed routing statistics
        if start <= n and stop > 1:
            cos, sin = self.rotary.tables(x.shape[1], x)
            for layer in self.model.layers[max(start, 1) - 1 : min(stop, n + 1) - 1]:
                x, layer_aux = layer(x, cos, sin)
                if layer_aux.dim():
                    stats = layer_aux if stats is None else stats + layer_aux
                else:
                    aux = aux + layer_aux
        if stats is not None:
            pool = self.aux_pool()
            assert pool is not None
            aux = aux + pool.pooled_loss(stats)
        if stop <= n + 1:
            return ModelOutput(logits=x, lm_loss=None, aux_loss=aux, aux_stats=stats)
        logits = self.lm_head(self.model.norm(x))
        lm_loss = None
        if targets is not None:
            lm_loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
            )
        return ModelOutput(logits=logits, lm_loss=lm_loss, aux_loss=aux, aux_stats=stats)


def _sizes(model_config: object) -> LlamaSizes:
    from bulkhead.trainer.models.spec_sizes import resolve

    return resolve(model_config, "llama")


FAMILY = ModelFamily(
    name="llama",
    sizes=_sizes,
    build=Llama,
    hf=LLAMA,
    description="Llama-2/3: RMSNorm, rotary (Llama-3 scaling), grouped-query attention, SwiGLU",
)
