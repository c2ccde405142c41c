"""Tiny random transformers models (the oracle) and their names in bulkhead's layout."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from bulkhead.trainer.models.protocol import ModelFamily

VOCAB = 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    values.update(overrides)
    return LlamaConfig(**values)


def mixtral_config(**overrides: Any) -> Any:
    from transformers import MixtralConfig

    values: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
    }
    values.update(overrides)
    return MixtralConfig(**values)


def hf_model(config: Any, seed: int = 0) -> Any:
    """A transformers model with random weights from ``seed`` (norms too, so that a
    mapping mistake in them shows), in fp32 and eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def as_bulkhead(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory names and fused experts -> bulkhead's per-expert names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        fused = _FUSED.match(name)
        if fused is not None:
            layer, kind = fused.groups()
            for e in range(t.shape[0]):
                prefix = f"{layer}.block_sparse_moe.experts.{e}"
                if kind == "down_proj":
                    out[f"{prefix}.w2.weight"] = t[e]
                else:
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{prefix}.w1.weight"], out[f"{prefix}.w3.weight"] = w1, w3
            continue
        out[name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t
    return out


def save_fused(model: Any, directory: Path) -> None:
    """Write ``model`` with its experts fused (transformers 5's in-memory layout), the other
    layout seen in published checkpoints."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def shifted(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets aligned with the inputs (the last position ignored), so bulkhead's
    ``lm_loss`` equals transformers' loss for ``labels=tokens``."""
    ignore = torch.full_like(tokens[:, :1], -100)
    return torch.cat([tokens[:, 1:], ignore], dim=1)


def _no_build(sizes: Any) -> Any:
    raise AssertionError("export must refuse a family without a Hugging Face counterpart first")


# A user family (``spec.trainer.model.family: hf_models:NO_HF``) with no Hugging Face
# counterpart, as the gpt family is.
NO_HF = ModelFamily(name="no-hf", sizes=lambda model: None, build=_no_build)
