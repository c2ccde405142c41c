"""Hugging Face ``config.json`` <-> ``LlamaSizes`` for the llama and mixtral families (pure).

Reading accepts both ways the rotary settings are written in the wild: transformers 5's
``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``. Writing emits both,
so transformers 4 and 5 (and tools that follow either) read the same sizes. Every error
names the ``config.json`` key and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bulkhead.trainer.config import MoESizes
from bulkhead.trainer.models.sizes import LlamaSizes, RopeScaling

CONFIG_FILE = "config.json"


class ConfigError(ValueError):
    """A config.json this build cannot map to a bulkhead family."""


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file (a Hugging Face model directory has one)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


@dataclass(frozen=True)
class HFMapping:
    """One family's Hugging Face counterpart (``ModelFamily.hf``)."""

    family: str
    architecture: str
    model_type: str
    moe: bool

    def sizes(self, config: dict[str, Any], source: str = CONFIG_FILE) -> LlamaSizes:
        """The sizes a ``config.json`` describes; ConfigError names the key it cannot use."""
        get = _Getter(config, source)
        for key, wanted in (("attention_bias", False), ("mlp_bias", False)):
            if config.get(key, wanted) != wanted:
                raise ConfigError(f"{source}: {key} is {config[key]!r}; bulkhead has no biases")
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {config['hidden_act']!r} is not 'silu'")
        if config.get("pretraining_tp", 1) != 1:
            raise ConfigError(f"{source}: pretraining_tp must be 1, got {config['pretraining_tp']}")
        theta, scaling = _rope(config, source)
        heads = get.int("num_attention_heads")
        max_positions = get.int("max_position_embeddings")
        moe = None
        if self.moe:
            if config.get("router_jitter_noise") or 0.0:
                raise ConfigError(f"{source}: router_jitter_noise must be 0 (bulkhead has none)")
            window = config.get("sliding_window")
            if window is not None and window < max_positions:
                raise ConfigError(
                    f"{source}: sliding_window {window} < max_position_embeddings: bulkhead "
                    "attends over the whole sequence"
                )
            moe = MoESizes(
                num_experts=get.int("num_local_experts"),
                top_k=get.int("num_experts_per_tok"),
                every=1,
                load_balance_coef=float(config.get("router_aux_loss_coef", 0.001)),
            )
        return LlamaSizes(
            vocab_size=get.int("vocab_size"),
            d_model=get.int("hidden_size"),
            n_layers=get.int("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            ffn_dim=get.int("intermediate_size"),
            seq_len=max_positions,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(config.get("head_dim") or 0),
            max_positions=max_positions,
            dropout=float(config.get("attention_dropout", 0.0)),
            moe=moe,
            initializer_range=float(config.get("initializer_range", 0.02)),
        )

    def config(self, sizes: LlamaSizes, dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` of a model of ``sizes`` whose tensors are ``dtype``."""
        if (sizes.moe is not None) != self.moe:
            raise ValueError(f"{self.family}: sizes {'without' if self.moe else 'with'} experts")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": sizes.rope_theta}
        if sizes.rope_scaling is not None:
            s = sizes.rope_scaling
            rope = {
                "rope_type": "llama3",
                "rope_theta": sizes.rope_theta,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": sizes.vocab_size,
            "hidden_size": sizes.d_model,
            "intermediate_size": sizes.ffn_dim,
            "num_hidden_layers": sizes.n_layers,
            "num_attention_heads": sizes.n_heads,
            "num_key_value_heads": sizes.n_kv_heads,
            "head_dim": sizes.head_dim,
            "max_position_embeddings": sizes.max_positions,
            "rms_norm_eps": sizes.rms_norm_eps,
            "rope_parameters": rope,
            "rope_theta": sizes.rope_theta,
            "rope_scaling": None if sizes.rope_scaling is None else rope,
            "tie_word_embeddings": sizes.tie_embeddings,
            "hidden_act": "silu",
            "attention_dropout": sizes.dropout,
            "initializer_range": sizes.initializer_range,
            "torch_dtype": dtype,
            "dtype": dtype,
        }
        if self.moe:
            assert sizes.moe is not None
            if sizes.moe.every != 1:
                raise ValueError(
                    "spec.trainer.model.moe.every: Mixtral routes every block; "
                    f"got {sizes.moe.every}"
                )
            config |= {
                "num_local_experts": sizes.moe.num_experts,
                "num_experts_per_tok": sizes.moe.top_k,
                "router_aux_loss_coef": sizes.moe.load_balance_coef,
                "router_jitter_noise": 0.0,
                "output_router_logits": False,
                "sliding_window": None,
            }
        else:
            config |= {"attention_bias": False, "mlp_bias": False}
        return config


LLAMA = HFMapping(family="llama", architecture="LlamaForCausalLM", model_type="llama", moe=False)
MIXTRAL = HFMapping(
    family="mixtral", architecture="MixtralForCausalLM", model_type="mixtral", moe=True
)
MAPPINGS = (LLAMA, MIXTRAL)


def mapping_for(config: dict[str, Any], source: str = CONFIG_FILE) -> HFMapping:
    """The family a ``config.json`` describes, by ``architectures`` (else ``model_type``)."""
    architectures = config.get("architectures") or []
    for mapping in MAPPINGS:
        if mapping.architecture in architectures:
            return mapping
    if not architectures:
        for mapping in MAPPINGS:
            if config.get("model_type") == mapping.model_type:
                return mapping
    known = ", ".join(m.architecture for m in MAPPINGS)
    raise ConfigError(
        f"{source}: unknown architecture {architectures or config.get('model_type')!r}; "
        f"bulkhead reads {known}"
    )


def with_seq_len(sizes: LlamaSizes, seq_len: int) -> LlamaSizes:
    """``sizes`` training on sequences of ``seq_len`` (at most max_position_embeddings)."""
    if seq_len > sizes.max_positions:
        raise ValueError(
            f"spec.trainer.model.seqLen: {seq_len} is longer than the checkpoint's "
            f"max_position_embeddings ({sizes.max_positions})"
        )
    return replace(sizes, seq_len=seq_len)


class _Getter:
    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config, self.source = config, source

    def int(self, key: str) -> int:
        value = self.config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{self.source}: {key} must be a positive integer, got {value!r}")
        return value


def _rope(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: {key} must be an object")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(
            f"{source}: {key}.rope_type {rope_type!r} is not supported (default, llama3)"
        )
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ConfigError(f"{source}: {key} of rope_type llama3 lacks {exc.args[0]}") from None
    return theta, scaling
