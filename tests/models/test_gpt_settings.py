"""Settings the gpt family cannot honour are refused, naming the field (no silent ignore)."""

from __future__ import annotations

import pytest

from bulkhead.api.spec import ModelConfig, TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.models.registry import family


@pytest.mark.parametrize(
    ("field", "value"),
    [("nKvHeads", 2), ("ropeTheta", 5e5), ("tieEmbeddings", False), ("pretrained", {"path": "/x"})],
)
def test_llama_only_fields_are_refused_for_gpt(field, value):
    with pytest.raises(ValueError, match=rf"spec\.trainer\.model\.{field}: the gpt family has no"):
        family("gpt").sizes(ModelConfig.model_validate({"preset": "tiny", field: value}))


def test_a_llama_job_resolves_through_the_registry():
    spec = TrainingJobSpec.model_validate(
        {"workers": 1, "trainer": {"model": {"family": "llama", "preset": "tiny"}}}
    )
    cfg = train_config(spec)
    assert cfg.family.name == "llama"
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.moe) == (64, 2, None)
