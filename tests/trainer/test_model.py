"""Config resolution, the ``gpt`` family's decoder and its Mixture-of-Experts blocks."""

from __future__ import annotations

import pytest
import torch

from bulkhead.api.spec import ModelConfig, TrainingJobSpec
from bulkhead.trainer.config import PRESETS, ModelSizes, resolve_model, train_config
from bulkhead.trainer.models.gpt import FAMILY, GPT, GPTMoE
from bulkhead.trainer.models.protocol import MoELayer, Routing, build_seeded

torch.set_num_threads(1)


def build_model(sizes: ModelSizes, seed: int) -> GPT:
    model = build_seeded(FAMILY, sizes, seed)
    assert isinstance(model, GPT)
    return model


def _wire_round_trip(model: dict) -> ModelConfig:
    """The model config as a worker sees it: through the spec's wire form."""
    spec = TrainingJobSpec.model_validate({"workers": 1, "trainer": {"model": model}})
    return TrainingJobSpec.model_validate(spec.wire()).trainer.model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_resolve_to_their_sizes(preset: str) -> None:
    sizes = resolve_model(_wire_round_trip({"preset": preset}))
    expected = PRESETS[preset]
    assert (sizes.d_model, sizes.n_layers, sizes.seq_len) == (
        expected["d_model"],
        expected["n_layers"],
        expected["seq_len"],
    )
    assert (sizes.moe is not None) == preset.endswith("-moe")


def test_explicit_fields_override_the_preset() -> None:
    sizes = resolve_model(
        _wire_round_trip({"preset": "small-moe", "nLayers": 6, "moe": {"numExperts": 3, "topK": 1}})
    )
    assert sizes.n_layers == 6
    assert sizes.d_model == PRESETS["small-moe"]["d_model"]
    assert sizes.moe is not None and (sizes.moe.num_experts, sizes.moe.top_k) == (3, 1)


def test_a_field_given_at_its_default_value_overrides_the_preset() -> None:
    """nLayers 4 is the field's default; the tiny preset has 2 layers. The moe fields merge
    into the preset's experts: topK given, numExperts and every kept from tiny-moe."""
    sizes = resolve_model(_wire_round_trip({"preset": "tiny", "nLayers": 4, "seqLen": 64}))
    assert (sizes.n_layers, sizes.d_model) == (4, PRESETS["tiny"]["d_model"])
    moe = resolve_model(_wire_round_trip({"preset": "tiny-moe", "moe": {"topK": 1}})).moe
    preset_moe = PRESETS["tiny-moe"]["moe"]
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.every) == (
        preset_moe["num_experts"], 1, preset_moe["every"],
    )  # fmt: skip


def test_no_preset_uses_the_fields_and_default_ffn() -> None:
    sizes = resolve_model(_wire_round_trip({"dModel": 48, "nHeads": 3}))
    assert (sizes.d_model, sizes.ffn_dim, sizes.moe) == (48, 192, None)


def test_bad_sizes_are_user_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="nHeads"):
        resolve_model(_wire_round_trip({"preset": "tiny", "nHeads": 5}))
    with pytest.raises(ValueError, match=r"moe\.every"):
        resolve_model(_wire_round_trip({"nLayers": 2, "moe": {"every": 3}}))
    spec = TrainingJobSpec.model_validate({"workers": 1, "trainer": {"model": {"vocabSize": 100}}})
    with pytest.raises(ValueError, match="vocabSize"):
        train_config(spec)


def test_moe_blocks_follow_every() -> None:
    sizes = resolve_model(_wire_round_trip({"nLayers": 4, "moe": {"every": 2}}))
    model = build_model(sizes, seed=0)
    kinds = [isinstance(b.ffn, MoELayer) for b in model.blocks]
    assert kinds == [False, True, False, True]
    assert sorted(model.moe_layers()) == [1, 3]
    assert model.moe_path(1) == "blocks.1.ffn"
    # Experts are keyed by their index, so the parameter names are those of a ModuleList.
    assert "blocks.1.ffn.experts.3.up.weight" in dict(model.named_parameters())


def test_units_ties_and_decay_groups() -> None:
    sizes = resolve_model(_wire_round_trip({"preset": "tiny"}))
    model = build_model(sizes, seed=0)
    n = len(model.blocks)
    names = dict(model.named_parameters())
    assert model.head.weight is model.tok_emb.weight
    assert {model.unit_of(name) for name in names} == set(range(n + 2))
    assert model.unit_of("pos_emb.weight") == 0 and model.unit_of("ln_f.weight") == n + 1
    decayed = {name for name, p in names.items() if model.decays(name, p)}
    assert "blocks.0.attn.qkv.weight" in decayed
    assert not decayed & {"tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight",
                          "blocks.0.attn.qkv.bias"}  # fmt: skip


def test_same_seed_same_weights_and_causal_logits() -> None:
    sizes = resolve_model(_wire_round_trip({"preset": "tiny-moe"}))
    a, b = build_model(sizes, seed=7), build_model(sizes, seed=7)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    # A later token never influences an earlier position's logits.
    a.eval()
    torch.testing.assert_close(a(tokens).logits[:, :10], a(changed).logits[:, :10])


def test_balance_loss_is_one_for_uniform_routing_and_larger_when_skewed() -> None:
    moe = GPTMoE(d_model=8, ffn_dim=16, num_experts=4, top_k=1, dropout=0.0)
    uniform_probs = torch.full((8, 4), 0.25)
    chosen = torch.arange(8).remainder(4).unsqueeze(1)
    ones = torch.ones(8, 1)
    assert moe.aux_loss(Routing(uniform_probs, ones, chosen)).item() == pytest.approx(1.0)
    skewed_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    skewed = Routing(skewed_probs, ones, torch.zeros(8, 1, dtype=torch.long))
    assert moe.aux_loss(skewed).item() > 2.5


def test_moe_output_mixes_only_the_chosen_experts() -> None:
    torch.manual_seed(0)
    moe = GPTMoE(d_model=8, ffn_dim=16, num_experts=4, top_k=2, dropout=0.0)
    x = torch.randn(3, 5, 8)
    out, aux = moe(x)
    tokens = x.reshape(-1, 8)
    probs = torch.softmax(moe.router(tokens), dim=-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.stack(
        [
            sum(weights[t, k] * moe.experts[str(int(chosen[t, k]))](tokens[t]) for k in range(2))
            for t in range(tokens.shape[0])
        ]
    )
    torch.testing.assert_close(out.reshape(-1, 8), expected)
    assert aux.item() >= 1.0 - 1e-6  # the balance loss is minimal (1) only when uniform


def test_tiny_moe_learns_real_text() -> None:
    from bulkhead.trainer.data import ByteDataset, load_corpus

    sizes = resolve_model(_wire_round_trip({"preset": "tiny-moe"}))
    import sysconfig
    from pathlib import Path

    corpus = load_corpus(str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"), 1 << 20)
    data = ByteDataset(corpus, sizes.seq_len, seed=0)
    model = build_model(sizes, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        batch = data.batch(list(range(step * 8, step * 8 + 8)))
        out = model(batch.inputs, batch.targets)
        opt.zero_grad()
        out.total(0.01).backward()
        opt.step()
        losses.append(out.lm_loss.item())
    assert losses[0] > 5.0  # about ln(256): an untrained byte model
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
