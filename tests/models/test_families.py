"""The llama and mixtral families keep the protocol the engine relies on."""

from __future__ import annotations

import pytest
import torch

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.models.protocol import MoELayer, local_dispatch
from bulkhead.trainer.models.registry import family


def _model(name: str, **fields):
    fam = family(name)
    sizes = fam.sizes(ModelConfig.model_validate({"family": name, "preset": "tiny", **fields}))
    torch.manual_seed(0)
    return fam.build(sizes), sizes


@pytest.mark.parametrize(("name", "tied"), [("llama", True), ("mixtral", False)])
def test_stages_chain_to_the_whole_model(name, tied):
    model, sizes = _model(name, tieEmbeddings=tied)
    tokens = torch.randint(0, sizes.vocab_size, (2, 12))
    whole = model(tokens, tokens)
    n = sizes.n_layers
    first = model(tokens, units=(0, 2))
    last = model(first.logits, tokens, units=(2, n + 2))
    torch.testing.assert_close(last.logits, whole.logits)
    torch.testing.assert_close(last.lm_loss, whole.lm_loss)
    if name == "mixtral":  # the loss pools every layer: the stages add up statistics
        assert first.aux_stats is not None and last.aux_stats is not None
        pooled = model.aux_pool().pooled_loss(first.aux_stats + last.aux_stats)
        torch.testing.assert_close(pooled, whole.aux_loss)
    else:
        assert whole.aux_stats is None
        torch.testing.assert_close(first.aux_loss + last.aux_loss, whole.aux_loss)
    assert first.lm_loss is None and first.logits.shape == (2, 12, sizes.d_model)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_units_own_every_parameter_once(name):
    model, sizes = _model(name, tieEmbeddings=True)
    n = sizes.n_layers
    by_units = {
        id(p): unit
        for unit in range(n + 2)
        for m in model.unit_modules(unit)
        for p in m.parameters()
    }
    for param, p in model.named_parameters():
        assert model.unit_of(param) in range(n + 2)
        assert id(p) in by_units, param
    assert model.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.unit_modules(n + 1)[-1].weight is model.model.embed_tokens.weight
    no_decay = {p for p, t in model.named_parameters() if not model.decays(p, t)}
    assert "model.embed_tokens.weight" in no_decay and "model.norm.weight" in no_decay
    assert "model.layers.0.self_attn.q_proj.weight" not in no_decay


def test_meta_build_materialises_and_reties():
    fam = family("llama")
    sizes = fam.sizes(ModelConfig.model_validate({"family": "llama", "preset": "tiny",
                                                  "tieEmbeddings": True}))  # fmt: skip
    with torch.device("meta"):
        model = fam.build(sizes)
    model = model.to_empty(device="cpu")
    model.retie()
    torch.manual_seed(0)
    model.init_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference, _ = _model("llama", tieEmbeddings=True)
    for (name, a), (_, b) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name  # init_weights from the seed = a seeded build


def test_mixtral_experts_are_whole_modules_and_dispatch_is_pluggable():
    model, sizes = _model("mixtral")
    layers = model.moe_layers()
    assert sorted(layers) == list(range(sizes.n_layers))
    for block, layer in layers.items():
        assert isinstance(layer, MoELayer) and layer.router is layer.gate
        prefix = f"{model.moe_path(block)}.experts."
        names = [n for n, _ in model.named_parameters() if n.startswith(prefix)]
        assert sorted({n.removeprefix(prefix).split(".")[0] for n in names}) == ["0", "1", "2", "3"]
        fresh = layer.new_expert()
        assert [p.shape for p in fresh.parameters()] == [
            p.shape for p in layer.experts["0"].parameters()
        ]
    tokens = torch.randint(0, sizes.vocab_size, (2, 8))
    expected = model(tokens).logits
    calls = []

    def counting(layer, x, routing):
        calls.append(routing.chosen.shape)
        return local_dispatch(layer, x, routing)

    for layer in layers.values():
        layer.dispatch = counting
    torch.testing.assert_close(model(tokens).logits, expected)
    assert calls == [(16, 2)] * sizes.n_layers


def test_router_weights_are_the_renormalised_top_k_of_a_softmax_over_all_experts():
    model, _ = _model("mixtral")
    layer = model.moe_layers()[0]
    x = torch.randn(5, layer.d_model)
    routing = layer.route(x)
    probs = torch.softmax(layer.gate(x), dim=-1)
    top, chosen = probs.topk(2, dim=-1)
    torch.testing.assert_close(routing.weights, top / top.sum(-1, keepdim=True))
    assert torch.equal(routing.chosen, chosen)
    # Uniform routing (every expert equally likely and chosen) gives top_k.
    uniform = type(routing)(
        probs=torch.full((4, 4), 0.25), weights=torch.full((4, 2), 0.5),
        chosen=torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]),
    )  # fmt: skip
    assert float(layer.aux_loss(uniform)) == pytest.approx(2.0)
