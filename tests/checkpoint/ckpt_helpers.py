"""Shared helpers for the checkpoint tests: deterministic states and waiting with a deadline."""

from __future__ import annotations

from typing import Any

import torch


def make_state(step: int, scale: int = 1) -> dict[str, Any]:
    """A state shaped like a real one whose every tensor encodes ``step``."""
    value = float(step)
    return {
        "model": {
            "embed.weight": torch.full((64 * scale, 32), value),
            "block.0.attn.weight": torch.full((32, 32), value, dtype=torch.bfloat16),
            "head.bias": torch.full((7,), value, dtype=torch.float64),
        },
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(value), "exp_avg": torch.full((64 * scale, 32), value)},
                1: {"step": torch.tensor(value), "exp_avg_sq": torch.full((32, 32), value)},
            },
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.95), "params": [0, 1]}],
        },
        "rng": {"torch": torch.get_rng_state(), "python": ("py", step)},
        "data": {"position": step * 16, "mask": torch.ones(3, dtype=torch.bool)},
    }


def assert_state_is(state: dict[str, Any], step: int, scale: int = 1) -> None:
    """Every tensor of ``state`` holds ``step`` (the layout of ``make_state``)."""
    expected = make_state(step, scale)
    for key, tensor in expected["model"].items():
        got = state["model"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got, tensor), f"{key} holds {got.flatten()[0]} not {step}"
    assert torch.equal(
        state["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"]
    )
    assert state["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert state["data"]["position"] == step * 16
    assert state["rng"]["python"] == ("py", step)
