"""Importing Hugging Face weights: each rank reads its rows only; errors name the tensor,
the file, the config.json key or the spec field."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from hf_models import hf_model, llama_config, mixtral_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.models import from_pretrained
from bulkhead.trainer.models.hf import ReadStats, WeightsError, read_params
from bulkhead.trainer.models.hf_config import ConfigError
from bulkhead.trainer.models.registry import family
from bulkhead.trainer.parallel.layout import KeySpec, shard_range

RANKS = 4


def _rank_child(directory: str, rank: int) -> tuple[int, dict[str, tuple[int, torch.Tensor]]]:
    """One rank of a ZeRO-sharded import (a process of its own): its torch.chunk rows of
    every parameter, as the engine's layout shards them."""
    fam = family("mixtral")
    with torch.device("meta"):
        model = fam.build(fam.hf.sizes(json.loads(Path(directory, "config.json").read_text())))
    wanted = {}
    for name, p in model.named_parameters():
        spec = KeySpec(f"param/{name}", p.numel(), p.shape[0], "float32", shardable=True)
        start, stop = shard_range(spec, RANKS, rank)
        if stop > start:
            wanted[name] = (start, stop)
    stats = ReadStats()
    got = read_params(directory, model, wanted, stats=stats)
    return stats.bytes, {name: (wanted[name][0], t) for name, t in got.items()}


def _stored_bytes(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                total += torch.Size(f.get_slice(name).get_shape()).numel() * 4  # float32
    return total


def test_four_ranks_each_read_their_share_of_a_sharded_checkpoint(tmp_path):
    hf = hf_model(mixtral_config(num_hidden_layers=2, num_local_experts=4))
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    stored = _stored_bytes(files)
    # fork: the ranks start with torch imported (spawn would import it once per rank).
    with multiprocessing.get_context("fork").Pool(RANKS) as pool:
        results = pool.starmap(_rank_child, [(str(tmp_path), r) for r in range(RANKS)])
    read = [b for b, _ in results]
    assert sum(read) == stored  # together the ranks read the model exactly once
    for b in read:
        assert abs(b - stored / RANKS) <= 0.1 * stored / RANKS, (read, stored)
    whole = dict(from_pretrained(tmp_path).model.named_parameters())
    for name, p in whole.items():
        flat = torch.full((p.numel(),), float("nan"))
        for _, pieces in results:
            if name in pieces:
                start, t = pieces[name]
                flat[start : start + t.numel()] = t
        assert torch.equal(flat, p.detach().reshape(-1)), name


def test_a_range_must_be_whole_rows(tmp_path):
    hf_model(llama_config()).save_pretrained(tmp_path)
    with pytest.raises(WeightsError, match=r"q_proj.weight: range \[0, 40\) is not whole rows"):
        read_params(tmp_path, "llama", {"model.layers.0.self_attn.q_proj.weight": (0, 40)})


def test_a_missing_tensor_is_named(tmp_path):
    hf_model(llama_config()).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"'model.layers.1.self_attn.k_proj.weight' is missing"):
        from_pretrained(tmp_path)


def test_a_shape_mismatch_names_the_tensor_and_file(tmp_path):
    hf_model(llama_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        WeightsError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj"
        r".weight' has shape \[48, 32\], the model needs \[40, 32\]",
    ):
        from_pretrained(tmp_path)


def test_an_unknown_architecture_is_named(tmp_path):
    hf_model(llama_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"config.json: unknown architecture \['GPT2LMHeadModel'\]"
    ):
        from_pretrained(tmp_path)


def test_spec_fields_must_agree_with_config_json(tmp_path):
    hf_model(mixtral_config()).save_pretrained(tmp_path)
    fam = family("mixtral")
    spec = {"family": "mixtral", "pretrained": {"path": str(tmp_path)}}
    sizes = fam.sizes(ModelConfig.model_validate({**spec, "seqLen": 32}))
    assert (sizes.d_model, sizes.n_kv_heads, sizes.seq_len, sizes.max_positions) == (32, 2, 32, 64)
    assert sizes.moe is not None and sizes.moe.load_balance_coef == 0.02
    for field, value, key in [
        ("dModel", 48, "hidden_size"),
        ("nKvHeads", 4, "num_key_value_heads"),
        ("tieEmbeddings", True, "tie_word_embeddings"),
        ("moe", {"numExperts": 8, "topK": 2}, "num_local_experts"),
    ]:
        with pytest.raises(ValueError, match=rf"spec.trainer.model.{field}.*{key} = .*config.json"):
            fam.sizes(ModelConfig.model_validate({**spec, field: value}))
    with pytest.raises(ValueError, match=r"seqLen: 128 is longer than .* max_position_embeddings"):
        fam.sizes(ModelConfig.model_validate({**spec, "seqLen": 128}))
    with pytest.raises(ValueError, match=r"spec.trainer.model.family: 'llama', but .* Mixtral"):
        family("llama").sizes(ModelConfig.model_validate({**spec, "family": "llama"}))


def test_sizes_from_the_spec_without_a_checkpoint():
    llama = family("llama").sizes(ModelConfig.model_validate({"family": "llama", "preset": "tiny",
                                                              "nLayers": 3}))  # fmt: skip
    assert (llama.n_layers, llama.n_kv_heads, llama.ffn_dim, llama.moe) == (3, 2, 128, None)
    dense = family("llama").sizes(ModelConfig(family="llama"))
    assert (dense.n_kv_heads, dense.ffn_dim, dense.tie_embeddings) == (4, 256, False)
    mixtral = family("mixtral").sizes(
        ModelConfig.model_validate({"family": "mixtral", "moe": {"numExperts": 8}})
    )
    assert mixtral.moe is not None and (mixtral.moe.num_experts, mixtral.moe.every) == (8, 1)
    with pytest.raises(ValueError, match=r"spec.trainer.model.moe: the mixtral family needs"):
        family("mixtral").sizes(ModelConfig(family="mixtral"))
    with pytest.raises(ValueError, match=r"spec.trainer.model.moe.every: the mixtral family"):
        family("mixtral").sizes(
            ModelConfig.model_validate({"family": "mixtral", "moe": {"every": 3}})
        )
    with pytest.raises(ValueError, match=r"spec.trainer.model.moe: the llama family is dense"):
        family("llama").sizes(ModelConfig.model_validate({"family": "llama", "moe": {}}))
    with pytest.raises(
        ValueError, match=r"spec.trainer.model.preset: the llama family has presets"
    ):
        family("llama").sizes(ModelConfig(family="llama", preset="tiny-moe"))


def test_ranges_are_read_straight_into_the_destinations_given(tmp_path):
    hf = hf_model(llama_config())
    hf.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = family("llama").build(
            family("llama").hf.sizes(json.loads(Path(tmp_path, "config.json").read_text()))
        )
    name = "model.layers.0.mlp.up_proj.weight"
    columns = dict(model.named_parameters())[name].shape[1]
    wanted = {name: (2 * columns, 5 * columns), "model.norm.weight": None}
    fresh = read_params(tmp_path, model, wanted)
    into = {name: torch.full((3 * columns,), float("nan"))}
    got = read_params(tmp_path, model, wanted, into=into)
    assert got[name].data_ptr() == into[name].data_ptr()  # filled in place, no copy
    assert torch.equal(into[name], fresh[name])
    assert torch.equal(got["model.norm.weight"], fresh["model.norm.weight"])  # no destination
    # another dtype than the file's: converted into the destination
    half = {name: torch.zeros(3 * columns, dtype=torch.bfloat16)}
    read_params(tmp_path, model, wanted, into=half)
    assert torch.equal(half[name], fresh[name].to(torch.bfloat16))
    with pytest.raises(WeightsError, match=r"up_proj.weight: the destination given holds 7"):
        read_params(tmp_path, model, wanted, into={name: torch.zeros(7)})
