"""Concrete sizes of the ``llama`` and ``mixtral`` families (pure: no torch).

``LlamaSizes`` is what a family's ``sizes(model_config)`` returns and what ``build`` and
the Hugging Face mapping take; ``moe`` set makes it a Mixtral. It carries the fields the
engine reads of every family's sizes (``vocab_size``, ``seq_len``, ``n_layers``,
``d_model``, ``moe``, ``is_moe_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

from bulkhead.trainer.config import MoESizes


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (Hugging Face ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaSizes:
    """Concrete sizes of a ``llama`` (``moe is None``) or ``mixtral`` model."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    seq_len: int  # tokens per training sequence
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: d_model // n_heads
    max_positions: int = 0  # Hugging Face max_position_embeddings (0: seq_len)
    dropout: float = 0.0  # attention dropout
    moe: MoESizes | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if not self.max_positions:
            object.__setattr__(self, "max_positions", self.seq_len)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"spec.trainer.model.nKvHeads: must divide nHeads ({self.n_heads}), "
                f"got {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {self.head_dim}")

    def is_moe_block(self, layer: int) -> bool:
        """Whether decoder block ``layer`` (0-based) has a routed feed-forward."""
        return self.moe is not None and (layer + 1) % self.moe.every == 0
