"""bulkhead's llama and mixtral against transformers: logits, loss, gradients, export."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_models import (
    LLAMA3_ROPE,
    VOCAB,
    as_bulkhead,
    hf_model,
    llama_config,
    mixtral_config,
    save_fused,
    shifted,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from bulkhead.trainer.models import from_pretrained
from bulkhead.trainer.models.hf_export import export_hf

CASES = {
    "llama-gqa-untied": lambda: llama_config(),
    "llama3-rope-tied": lambda: llama_config(
        tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, num_key_value_heads=1
    ),
    "llama-mha-theta": lambda: llama_config(
        num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}
    ),
    "mixtral-1-layer": lambda: mixtral_config(),
    "mixtral-2-layers-tied": lambda: mixtral_config(num_hidden_layers=2, tie_word_embeddings=True),
}


def _tokens(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("case", CASES)
def test_logits_loss_and_gradients_equal_transformers(case, tmp_path):
    config = CASES[case]()
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    torch.testing.assert_close(ours(tokens), expected, atol=1e-5, rtol=0)

    moe = case.startswith("mixtral")
    coef = config.router_aux_loss_coef if moe else 0.0
    hf.train()
    out = hf(input_ids=tokens, labels=tokens, output_router_logits=moe)
    model = ours.model.train()
    mine = model(tokens, shifted(tokens))
    if moe:
        # transformers pools the router decisions of every layer before the product.
        pooled = load_balancing_loss_func(
            out.router_logits, config.num_local_experts, config.num_experts_per_tok
        )
        torch.testing.assert_close(mine.aux_loss, pooled, atol=1e-6, rtol=0)
        if config.num_hidden_layers > 1:  # pooling differs from a sum of per-layer losses
            per_layer = sum(
                load_balancing_loss_func((logits,), config.num_local_experts, 2)
                for logits in out.router_logits
            )
            assert abs(float(per_layer.detach()) - float(pooled.detach())) > 0.5
    # transformers' loss (lm + coef x aux) is exactly our total, and so are its gradients.
    torch.testing.assert_close(mine.total(coef), out.loss, atol=1e-5, rtol=0)
    out.loss.backward()
    mine.total(coef).backward()
    expected_grads = as_bulkhead({n: p.grad for n, p in hf.named_parameters()})
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(expected_grads) - (
        {"lm_head.weight"} if config.tie_word_embeddings else set()
    )
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", ["llama3-rope-tied", "mixtral-2-layers-tied", "llama-gqa-untied"])
def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    hf = hf_model(CASES[case]())
    hf.save_pretrained(tmp_path / "in")
    ours = from_pretrained(tmp_path / "in")
    state = dict(ours.model.named_parameters())
    export_hf(state, ours.sizes, tmp_path / "out", shard_bytes=40_000, progress=False)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # several shards
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tokens).logits, ours(tokens), atol=1e-5, rtol=0)
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert from_pretrained(tmp_path / "out").sizes == ours.sizes


def test_fused_expert_layout_reads_the_same_model(tmp_path):
    hf = hf_model(mixtral_config(num_hidden_layers=2))
    hf.save_pretrained(tmp_path / "per-expert")
    save_fused(hf, tmp_path / "fused")
    per_expert = from_pretrained(tmp_path / "per-expert")
    fused = from_pretrained(tmp_path / "fused")
    a, b = dict(per_expert.model.named_parameters()), dict(fused.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), hf(input_ids=tokens).logits, atol=1e-5, rtol=0)
