"""Precision and activation checkpointing in one process: what runs in bf16, what stays
fp32, which blocks recompute, and what the planner predicts for each precision."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.precision import compute_dtype, fsdp_policy
from bulkhead.trainer.engine.world import open_world
from bulkhead.trainer.parallel.plan import make_plan, state_bytes_per_rank
from bulkhead.trainer.planning.costs import GpuSpec, estimate_layer_costs, recomputed_blocks


def config(precision: str, checkpointing: str = "none", family: str = "gpt") -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": 1,
            "trainer": {
                "model": {"family": family, "preset": "tiny"},
                "batch": {"globalBatchSize": 2, "microBatchSize": 2},
                "precision": precision,
                "activationCheckpointing": checkpointing,
            },
        }
    )
    return train_config(spec)


def test_blocks_each_mode_recomputes() -> None:
    assert recomputed_blocks(5, "none") == []
    assert recomputed_blocks(5, "full") == [0, 1, 2, 3, 4]
    assert recomputed_blocks(5, "selective") == [0, 2, 4]
    with pytest.raises(ValueError, match=r"spec\.trainer\.activationCheckpointing"):
        recomputed_blocks(5, "attention")


def test_precision_settings() -> None:
    assert compute_dtype("fp32") is None and compute_dtype("bf16") is torch.bfloat16
    policy = fsdp_policy("bf16")
    assert policy.param_dtype is torch.bfloat16 and policy.reduce_dtype is torch.float32
    assert fsdp_policy("fp32").param_dtype is None
    with pytest.raises(ValueError, match=r"spec\.trainer\.precision"):
        compute_dtype("fp16")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_bf16_computes_in_bf16_and_keeps_fp32_state(family: str) -> None:
    cfg = config("bf16", "selective", family)
    world = open_world(1, 0, ["w0"], ["n0"], dist.HashStore(), pick_device(False), 10)
    try:
        engine = build_engine(make_plan(1, ["w0"], ["n0"], cfg), world, cfg)
        engine.adopt(None)
        # Selective: block 0 recomputes in backward (its layers run twice), block 1 not.
        runs = {0: 0, 1: 0}
        dtypes: set[torch.dtype] = set()

        def count(block: int) -> Callable[..., None]:
            def hook(_m: object, _a: object, out: torch.Tensor) -> None:
                runs[block] += 1
                dtypes.add(out.dtype)

            return hook

        linears = [next(m for m in engine.model.blocks[b].modules()
                        if isinstance(m, torch.nn.Linear)) for b in (0, 1)]  # fmt: skip
        handles = [linear.register_forward_hook(count(b)) for b, linear in enumerate(linears)]
        result = engine.step(open_dataset(cfg))
        for handle in handles:
            handle.remove()
        assert result.loss > 0
        assert runs == {0: 2, 1: 1}
        assert dtypes == {torch.bfloat16}  # the matrix products ran in bf16
        # The state the optimizer updates and every snapshot key stay fp32.
        for spec, t in engine._entries:
            if spec.name.startswith(("param/", "optim/")) and t.is_floating_point():
                assert t.dtype is torch.float32, spec.name
        assert all(p.grad is None or p.grad.dtype is torch.float32
                   for p in engine.model.parameters())  # fmt: skip
    finally:
        world.close()


def test_the_planner_predicts_state_alike_and_activations_by_precision() -> None:
    shape = config("fp32").shape
    fp32 = estimate_layer_costs(shape, GpuSpec(), 4, "fp32")
    bf16 = estimate_layer_costs(shape, GpuSpec(), 4, "bf16")
    for a, b in zip(fp32, bf16, strict=True):
        # fp32 master weights, gradients and AdamW moments in either precision: 16 B/param.
        assert a.state_bytes == b.state_bytes
        assert (a.param_bytes, a.grad_bytes, a.optimizer_bytes) == (
            4 * a.param_bytes // 4, a.param_bytes, 2 * a.param_bytes
        )  # fmt: skip
        if a.name.startswith("block"):
            # gpt's count per token: LayerNorm inputs and statistics and the attention's
            # log-sum-exp in fp32; normalised inputs, q, k, v, attention output (6d) and
            # the MLP's GELU input and output (2 x 4d) in the compute dtype. bf16 halves
            # the compute values and keeps a bf16 copy of the weights.
            d, tokens = shape.d_model, 4 * shape.seq_len
            fp32_values, compute_values = 2 * d + 4 + shape.n_heads, 6 * d + 8 * d
            assert a.activation_bytes == tokens * 4 * (fp32_values + compute_values)
            assert b.activation_bytes == tokens * (4 * fp32_values + 2 * compute_values) + 2 * (
                a.param_bytes // 4
            )
    full = estimate_layer_costs(shape, GpuSpec(), 4, "bf16", "full")
    assert [c.activation_bytes for c in full[1:-1]] == [16 * shape.seq_len * shape.d_model] * 2
    params = sum(u.params for u in shape.units if u.name != "head")  # the head is tied
    one_rank = state_bytes_per_rank(make_plan(1, ["w0"], ["w0"], config("bf16")).zero, params)
    assert one_rank.total == 16 * params
    with pytest.raises(ValueError, match="precision"):
        estimate_layer_costs(shape, GpuSpec(), 4, "fp16")
