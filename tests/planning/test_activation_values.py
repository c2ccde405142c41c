"""The planner's activation bytes: a family's per-token count by dtype, or the generic rule."""

from __future__ import annotations

from bulkhead.trainer.planning.costs import (
    ActivationValues,
    ModelShape,
    UnitShape,
    activation_bytes,
)

D, SEQ, VOCAB = 8, 4, 16


def _shape(block: UnitShape) -> ModelShape:
    units = (UnitShape("embedding", 10, 10, "embedding"), block, UnitShape("head", 20, 20, "head"))
    return ModelShape(units=units, d_model=D, seq_len=SEQ, n_heads=2, vocab_size=VOCAB)


def test_values_are_priced_by_the_dtype_they_are_kept_in() -> None:
    values = ActivationValues(fp32=3, compute=5, bf16_casts=7, int64=1)
    assert values.bytes_per_token("fp32") == 3 * 4 + 5 * 4 + 1 * 8  # no casts in fp32
    assert values.bytes_per_token("bf16") == 3 * 4 + 5 * 2 + 7 * 2 + 1 * 8


def test_a_declared_count_replaces_the_generic_rule() -> None:
    declared = UnitShape("block0", 100, 100, "block", ActivationValues(fp32=2, compute=3))
    shape = _shape(declared)
    tokens = 6
    assert activation_bytes(shape, declared, tokens, "fp32") == tokens * (2 * 4 + 3 * 4)
    # bf16 adds autocast's bf16 copy of the unit's weights.
    assert activation_bytes(shape, declared, tokens, "bf16") == tokens * (2 * 4 + 3 * 2) + 200
    # A recomputed block keeps only its fp32 input, whatever it declares.
    assert activation_bytes(shape, declared, tokens, "bf16", recomputed=True) == tokens * D * 4


def test_an_undeclared_family_gets_the_generic_rule() -> None:
    block = UnitShape("block0", 100, 100, "block")
    shape = _shape(block)
    assert activation_bytes(shape, block, 6, "fp32") == 6 * D * 17 * 4
    assert activation_bytes(shape, block, 6, "bf16") == 6 * D * (17 * 2 + 4) + 200
    embedding = shape.units[0]
    assert activation_bytes(shape, embedding, 6, "bf16") == 6 * 8  # token ids; no weight copy
