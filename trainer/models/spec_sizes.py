"""``spec.trainer.model`` -> ``LlamaSizes`` for the llama and mixtral families.

Without pretrained weights the sizes are the family's preset, overridden by every explicit
field. With ``pretrained.path`` they come from the directory's ``config.json``; explicit
fields must agree with it (a mismatch names the spec field and the config.json key), except
the training settings ``seqLen`` (at most max_position_embeddings), ``dropout`` and
``moe.loadBalanceCoef``, which the job chooses. A field is explicit when the manifest
gives it, also at its default value (``ModelConfig.given``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from bulkhead.api.spec import MOE_DEFAULTS, ModelConfig, MoEConfig, RopeScalingConfig
from bulkhead.trainer.config import MoESizes
from bulkhead.trainer.models.hf_config import (
    CONFIG_FILE,
    LLAMA,
    MIXTRAL,
    mapping_for,
    read_config,
    with_seq_len,
)
from bulkhead.trainer.models.sizes import LlamaSizes, RopeScaling

_MOE = {"num_experts": 4, "top_k": 2, "every": 1, "load_balance_coef": 0.01}
# Each preset is a complete set of sizes (snake_case ModelConfig field names).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64,
                 "ffn_dim": 128},
        "small": {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "seq_len": 128,
                  "ffn_dim": 344},
    },
    "mixtral": {
        "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64,
                 "ffn_dim": 64, "moe": _MOE},
        "small": {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "seq_len": 128,
                  "ffn_dim": 128, "moe": {**_MOE, "num_experts": 8}},
    },
}  # fmt: skip

# spec field (snake_case) -> (wire name, config.json key, value in LlamaSizes)
_AGREE: dict[str, tuple[str, str]] = {
    "vocab_size": ("vocabSize", "vocab_size"),
    "d_model": ("dModel", "hidden_size"),
    "n_layers": ("nLayers", "num_hidden_layers"),
    "n_heads": ("nHeads", "num_attention_heads"),
    "n_kv_heads": ("nKvHeads", "num_key_value_heads"),
    "ffn_dim": ("ffnDim", "intermediate_size"),
    "rope_theta": ("ropeTheta", "rope_theta"),
    "rope_scaling": ("ropeScaling", "rope_scaling"),
    "rms_norm_eps": ("rmsNormEps", "rms_norm_eps"),
    "tie_embeddings": ("tieEmbeddings", "tie_word_embeddings"),
}
_AGREE_MOE: dict[str, tuple[str, str]] = {
    "num_experts": ("moe.numExperts", "num_local_experts"),
    "top_k": ("moe.topK", "num_experts_per_tok"),
    "every": ("moe.every", "(every block: Mixtral)"),
}


def _rope_scaling(value: RopeScalingConfig | dict[str, Any] | None) -> RopeScaling | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = RopeScalingConfig.model_validate(value)
    return RopeScaling(
        factor=value.factor,
        low_freq_factor=value.low_freq_factor,
        high_freq_factor=value.high_freq_factor,
        original_max_position_embeddings=value.original_max_position_embeddings,
    )


def resolve(model: ModelConfig, family: str) -> LlamaSizes:
    """The sizes of ``family`` (llama or mixtral) that ``model`` asks for (ValueError naming
    the spec field, or the config.json key, otherwise)."""
    if model.pretrained is not None:
        return _from_pretrained(model, family)
    presets = PRESETS[family]
    values: dict[str, Any] = {}
    if model.preset is not None:
        if model.preset not in presets:
            raise ValueError(
                f"spec.trainer.model.preset: the {family} family has presets "
                f"{', '.join(presets)}, got {model.preset!r}"
            )
        values.update(presets[model.preset])
    explicit = model.given()
    explicit.pop("preset", None)
    explicit.pop("family", None)
    moe_explicit = model.moe.given() if model.moe is not None else {}
    values.update({k: v for k, v in explicit.items() if k != "moe"})
    if family == "llama" and (model.moe is not None):
        raise ValueError("spec.trainer.model.moe: the llama family is dense; use family mixtral")
    moe: MoESizes | None = None
    if family == "mixtral":
        base = dict(values.get("moe") or {})
        if not base and model.moe is None:
            raise ValueError(
                "spec.trainer.model.moe: the mixtral family needs its experts "
                "(numExperts, topK) or a preset"
            )
        merged = {**MOE_DEFAULTS, "every": 1, **base, **moe_explicit}
        if merged["every"] != 1:
            raise ValueError(
                f"spec.trainer.model.moe.every: the mixtral family routes every block (1), "
                f"got {merged['every']}"
            )
        moe = MoESizes(**MoEConfig.model_validate(merged).given())
    defaults = ModelConfig()
    d_model = values.get("d_model", defaults.d_model)
    n_heads = values.get("n_heads", defaults.n_heads)
    if d_model % n_heads:
        raise ValueError(
            f"spec.trainer.model.nHeads: must divide dModel ({d_model}), got {n_heads}"
        )
    return LlamaSizes(
        vocab_size=values.get("vocab_size", defaults.vocab_size),
        d_model=d_model,
        n_layers=values.get("n_layers", defaults.n_layers),
        n_heads=n_heads,
        n_kv_heads=values.get("n_kv_heads") or n_heads,
        ffn_dim=values.get("ffn_dim") or 4 * d_model,
        seq_len=values.get("seq_len", defaults.seq_len),
        rope_theta=values.get("rope_theta", defaults.rope_theta),
        rope_scaling=_rope_scaling(values.get("rope_scaling")),
        rms_norm_eps=values.get("rms_norm_eps", defaults.rms_norm_eps),
        tie_embeddings=bool(values.get("tie_embeddings")),
        dropout=values.get("dropout", defaults.dropout),
        moe=moe,
    )


def _from_pretrained(model: ModelConfig, family: str) -> LlamaSizes:
    assert model.pretrained is not None
    directory = Path(model.pretrained.path)
    source = str(directory / CONFIG_FILE)
    if model.preset is not None:
        raise ValueError(
            "spec.trainer.model.preset: sizes come from pretrained.path's config.json; "
            "remove the preset"
        )
    try:
        config = read_config(directory)
    except ValueError as exc:
        raise ValueError(f"spec.trainer.model.pretrained.path: {exc}") from None
    mapping = mapping_for(config, source)
    wanted = {"llama": LLAMA, "mixtral": MIXTRAL}[family]
    if mapping is not wanted:
        raise ValueError(
            f"spec.trainer.model.family: {family!r}, but {source} holds a "
            f"{mapping.architecture} ({mapping.family!r})"
        )
    sizes = mapping.sizes(config, source)
    explicit = model.given()
    for name, (wire, key) in _AGREE.items():
        if name not in explicit:
            continue
        ours = explicit[name]
        theirs = getattr(sizes, name)
        if name == "rope_scaling":
            ours = _rope_scaling(ours)
        if ours != theirs:
            raise ValueError(
                f"spec.trainer.model.{wire}: {ours!r} disagrees with {key} = {theirs!r} in {source}"
            )
    if model.moe is not None:
        if sizes.moe is None:
            raise ValueError(f"spec.trainer.model.moe: {source} describes a dense model")
        moe_explicit = model.moe.given()
        for name, (wire, key) in _AGREE_MOE.items():
            if name in moe_explicit and moe_explicit[name] != getattr(sizes.moe, name):
                theirs = getattr(sizes.moe, name)
                raise ValueError(
                    f"spec.trainer.model.{wire}: {moe_explicit[name]!r} disagrees with "
                    f"{key} = {theirs!r} in {source}"
                )
        if "load_balance_coef" in moe_explicit:
            coef = moe_explicit["load_balance_coef"]
            sizes = replace(sizes, moe=replace(sizes.moe, load_balance_coef=coef))
    if "seq_len" in explicit:
        sizes = with_seq_len(sizes, explicit["seq_len"])
    if "dropout" in explicit:
        sizes = replace(sizes, dropout=explicit["dropout"])
    return sizes
