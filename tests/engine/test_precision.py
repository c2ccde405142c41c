"""bf16 mixed precision and activation checkpointing in every layout, in real gloo processes.

bf16 (``trainer.precision``): every layout (data parallelism, ZeRO-3 with hpZ, pipelines,
experts, and their composition across a killed pod) trains like one process in bf16. bf16
is not reproducible across reduction orders: the layouts sum gradients in other orders,
FSDP2 gathers parameters in bf16, pipelines send bf16 activations and experts receive bf16
tokens, and each difference is a bf16 rounding (relative 2^-9 = 2e-3) of some activation
that the following steps carry on. After 20 steps the losses are compared to
``LOSS_RTOL`` (relative) and the parameters by their L2 distance relative to the
reference's norm, to ``PARAM_RTOL``: measured 0.4e-3 to 1.2e-3, where fp32 layouts stay
within ~1e-6 and the bf16 reference ends 2.0e-3 from the fp32 one. The one-process bf16
run must differ from the fp32 one (``test_recipe`` checks what runs in bf16). The model
trains with SGD: AdamW's m / sqrt(v) turns a rounding of a near-zero gradient into a
fraction of a whole step (see ``test_family_equivalence``), which no tolerance tied to
bf16 covers.

Activation checkpointing (``trainer.activationCheckpointing``): recomputing blocks in
backward leaves every loss and the whole state (parameters and AdamW moments, which are
functions of the gradients) equal to the same layout without it, in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_harness import Outcome, Phase, run_scenario

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.parallel.plan import make_plan

pytestmark = pytest.mark.slow

STEPS = 20
SGD = {"optimizer": {"name": "sgd", "lr": 0.1}}
# Measured after 20 steps against the one-process bf16 run: losses 0.6e-3 to 1.3e-3
# relative, parameters 0.4e-3 to 1.2e-3 relative L2 distance (fp32 layouts: ~1e-6).
LOSS_RTOL = 3e-3
PARAM_RTOL = 2e-3
G = 2  # processes per pod in the composed layout


def config(
    workers: int,
    precision: str = "bf16",
    processes: int = 1,
    max_failures: int = 0,
    checkpointing: str = "none",
    optimizer: dict | None = None,
    **parallelism: object,
) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "processesPerWorker": processes,
            "trainer": {
                "model": {"preset": "tiny-moe"},
                "batch": {"globalBatchSize": 8, "microBatchSize": processes},
                "steps": 100,
                "precision": precision,
                "activationCheckpointing": checkpointing,
                "parallelism": parallelism,
                **(optimizer if optimizer is not None else SGD),
            },
            "faultTolerance": {"maxFailures": max_failures},
        }
    )
    return train_config(spec)


def param_distance(a: Outcome, b: Outcome) -> float:
    """L2 distance of ``a``'s parameters from ``b``'s, relative to ``b``'s norm."""
    assert a.full_state.keys() == b.full_state.keys()
    keys = sorted(k for k in b.full_state if k.startswith("param/"))
    va = torch.cat([a.full_state[k].double() for k in keys])
    vb = torch.cat([b.full_state[k].double() for k in keys])
    return float((va - vb).norm() / vb.norm())


def loss_distance(a: Outcome, b: Outcome) -> float:
    """The largest relative difference of the losses of the steps both ran."""
    steps = a.losses.keys() & b.losses.keys()
    assert steps
    return max(abs(a.losses[s] - b.losses[s]) / abs(b.losses[s]) for s in steps)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """20 steps on one process, in bf16 and in fp32."""
    out = {}
    for precision in ("bf16", "fp32"):
        tmp = tmp_path_factory.mktemp(precision)
        out[precision] = run_scenario(config(1, precision), [Phase((0,), STEPS)], tmp)[0]
    bf16, fp32 = out["bf16"], out["fp32"]
    assert bf16.losses[STEPS - 1] < bf16.losses[0]  # it trained
    # bf16 is honoured: its losses are not fp32's (measured: 1.7e-3 apart at most).
    assert loss_distance(bf16, fp32) > 3e-4
    return out


def assert_equals_bf16_reference(result: Outcome, refs: dict[str, Outcome]) -> None:
    assert sorted(result.losses)[-1] == STEPS - 1
    assert loss_distance(result, refs["bf16"]) <= LOSS_RTOL
    assert param_distance(result, refs["bf16"]) <= PARAM_RTOL


LAYOUTS = {
    "data-parallel": {},
    "zero3-hpz": {"zero": {"stage": 3, "hpzPartitionSize": 2}},
    "pipelines": {"pipeline": {"minStages": 2}},
    "experts": {"experts": {"rebalanceIntervalSteps": 0}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_layouts_equal_one_bf16_process(
    layout: str, references: dict[str, Outcome], tmp_path: Path
) -> None:
    cfg = config(4, **LAYOUTS[layout])
    out = run_scenario(cfg, [Phase((0, 1, 2, 3), STEPS)], tmp_path)
    assert out[0].adoptions == [(1, "fresh", 0)]
    assert_equals_bf16_reference(out[0], references)


def test_bf16_composition_with_a_killed_pod_equals_one_bf16_process(
    references: dict[str, Outcome], tmp_path: Path
) -> None:
    # 3 pods of 2 processes: pipelines of 2 and 1 stages, ZeRO-3 over each pod, each MoE
    # block's experts spread over the pod. The 2-stage pipeline's last pod dies inside
    # step 10; the survivors redo it and end where the one process ends after 20 steps.
    cfg = config(3, processes=G, max_failures=1, pipeline={"minStages": 1},
                 zero={"stage": 3}, experts={})  # fmt: skip
    ranks = [f"w{r // G}" for r in range(3 * G)]
    layout = make_plan(1, ranks, ranks, cfg).pipelines
    assert layout is not None and sorted(len(p) for p in layout.stages) == [1, 2]
    last = next(p[-1] for p in layout.stages if len(p) == 2)
    killed = (last.rank, last.rank + 1)
    slots = tuple(range(3 * G))
    survivors = tuple(s for s in slots if s not in killed)
    phases = [Phase(slots, 11, kill_after=killed), Phase(survivors, 10)]
    out = run_scenario(cfg, phases, tmp_path)
    result = out[min(survivors)]
    assert result.errors, "the kill should have failed step 10 on the survivors"
    assert result.adoptions == [(1, "fresh", 0), (2, "peers", 10)]
    assert_equals_bf16_reference(result, references)


# Activation checkpointing: fp32, AdamW, a few steps, the same layout with and without.
AC_STEPS = 6
ADAMW = {"optimizer": {"name": "adamw"}}
AC_LAYOUTS = {
    "data-parallel-selective": (dict(workers=2), "selective"),
    "composed-full": (
        dict(workers=3, processes=G, pipeline={"minStages": 1}, zero={"stage": 3}, experts={}),
        "full",
    ),
}


@pytest.mark.parametrize("layout", list(AC_LAYOUTS))
def test_activation_checkpointing_leaves_losses_and_state_unchanged(
    layout: str, tmp_path: Path
) -> None:
    kwargs, mode = AC_LAYOUTS[layout]
    slots = tuple(range(kwargs["workers"] * kwargs.get("processes", 1)))
    runs = {}
    for checkpointing in ("none", mode):
        cfg = config(precision="fp32", checkpointing=checkpointing, optimizer=ADAMW, **kwargs)
        runs[checkpointing] = run_scenario(cfg, [Phase(slots, AC_STEPS)], tmp_path / checkpointing)[
            0
        ]
    plain, recomputed = runs["none"], runs[mode]
    assert sorted(recomputed.losses) == list(range(AC_STEPS))
    for step, loss in plain.losses.items():
        assert abs(recomputed.losses[step] - loss) <= 1e-6 * abs(loss), step
    assert recomputed.full_state.keys() == plain.full_state.keys()
    for key, expected in plain.full_state.items():  # parameters and AdamW's moments
        torch.testing.assert_close(recomputed.full_state[key], expected, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=key: f"{k}: {m}")  # fmt: skip
