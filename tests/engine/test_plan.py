"""The parallel plan: a pure function of membership and spec, the same on every rank."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bulkhead.api.spec import TrainingJobSpec, zero_shard_group_size
from bulkhead.trainer.config import train_config
from bulkhead.trainer.parallel.plan import make_plan, shard_id, state_bytes_per_rank, zero_plan


def _cfg(stage: int, hpz: int = 1, workers: int = 4, f: int = 1, gb: int = 8, processes=None):
    return train_config(
        TrainingJobSpec.model_validate(
            {
                "workers": workers,
                "processesPerWorker": processes,
                "trainer": {
                    "model": {"preset": "tiny"},
                    "batch": {"globalBatchSize": gb, "microBatchSize": 2},
                    "parallelism": {"zero": {"stage": stage, "hpzPartitionSize": hpz}},
                },
                "faultTolerance": {"maxFailures": f},
            }
        )
    )


@given(st.integers(1, 512), st.integers(0, 8))
def test_shard_groups_divide_the_workers_and_keep_f_plus_1_copies(workers: int, f: int) -> None:
    size = zero_shard_group_size(workers, f)
    assert workers % size == 0
    if workers >= f + 1:
        assert workers // size >= f + 1
        # no larger divisor keeps the copies
        assert not any(
            workers % s == 0 and workers // s >= f + 1 for s in range(size + 1, workers + 1)
        )
    else:
        assert size == 1


@given(st.integers(1, 64), st.integers(0, 4), st.integers(1, 8))
def test_shard_groups_of_pods_hold_whole_pods(workers: int, f: int, g: int) -> None:
    """With G processes per pod, a shard group is whole pods, so a pod's loss costs one
    copy of its shards only, and f pod losses leave a holder of every shard."""
    plan = zero_plan(3, 1, workers * g, f, g)
    if workers < f + 1:
        assert not plan.sharded
        return
    assert plan.shard_size % g == 0
    assert plan.replicas >= f + 1
    assert plan.shard_size == zero_shard_group_size(workers, f) * g
    for pod in range(workers):
        groups = {plan.replica_index(pod * g + i) for i in range(g)}
        assert len(groups) == 1, "a pod's processes would span shard groups"


def test_pods_are_whole_in_the_plan() -> None:
    with pytest.raises(ValueError, match="whole worker pods"):
        zero_plan(2, 1, 5, 1, 2)
    cfg = _cfg(2, workers=2, f=1, processes=2)
    plan = make_plan(1, ["a", "a", "b", "b"], ["n1", "n1", "n2", "n2"], cfg)
    assert (plan.zero.shard_size, plan.zero.replicas) == (2, 2)
    assert plan.describe()[0].startswith("generation 1: 2 worker(s) x 2 processes")


def test_zero_plan_meshes() -> None:
    assert zero_plan(0, 1, 4, 1) == zero_plan(0, 1, 4, 1)
    plain = zero_plan(0, 1, 4, 1)
    assert not plain.sharded and plain.replicas == 4
    z3 = zero_plan(3, 2, 4, 1)  # S = 2: h = 2 would be plain ZeRO-3, so no hpZ
    assert (z3.shard_size, z3.replicas, z3.hpz) == (2, 2, 1) and z3.sharded
    assert zero_plan(3, 2, 4, 0).hpz == 2  # one group of 4 shards: blocks of 2
    assert [z3.shard_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert [z3.replica_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert z3.holders_of_shard(1) == [1, 3]
    big = zero_plan(3, 4, 16, 1)  # groups of 8, hpZ blocks of 4
    assert (big.shard_size, big.replicas, big.hpz) == (8, 2, 4)
    # Fewer workers than the spec asked for: the groups shrink, hpZ to what divides them.
    degraded = zero_plan(3, 2, 3, 1)
    assert not degraded.sharded and degraded.replicas == 3 and degraded.hpz == 1
    six = zero_plan(3, 4, 6, 1)  # groups of 3: hpZ 4 does not divide, gcd 1 = off
    assert (six.shard_size, six.hpz) == (3, 1)


def test_plan_shares_ids_and_persisting_holders() -> None:
    workers = [f"w{i}" for i in range(4)]
    plan = make_plan(7, workers, ["a", "a", "b", "b"], _cfg(3, 1))
    assert plan.world_size == 4 and plan.generation == 7
    assert [plan.checkpoint_shard(r) for r in range(4)] == [
        "zero2-s0", "zero2-s1", "zero2-s0", "zero2-s1",
    ]  # fmt: skip
    assert plan.checkpoint_shards() == ("zero2-s0", "zero2-s1")
    assert [plan.persists(r) for r in range(4)] == [True, True, False, False]
    assert plan.state_copies() == 2
    text = "\n".join(plan.describe())
    assert "ZeRO-3: 2 replica group(s) x 2 shard(s); every shard on 2" in text
    eight = [f"w{i}" for i in range(8)]
    hpz = make_plan(1, eight, eight, _cfg(3, 2, workers=8))
    assert "ZeRO-3: 2 replica group(s) x 4 shard(s), hpZ blocks of 2" in hpz.describe()[1]
    dp = make_plan(1, workers, workers, _cfg(0))
    assert {dp.checkpoint_shard(r) for r in range(4)} == {"dp"} == set(dp.checkpoint_shards())
    assert [dp.persists(r) for r in range(4)] == [True, False, False, False]
    assert shard_id(1, 0) == "dp" and shard_id(4, 3) == "zero4-s3"


@given(st.integers(1, 64), st.integers(1, 4096))
def test_shares_tile_the_global_batch(workers: int, gb: int) -> None:
    names = [f"w{i}" for i in range(workers)]
    plan = make_plan(1, names, names, _cfg(0, gb=max(gb, 2)))
    shares = [plan.share(r) for r in range(workers)]
    offset = 0
    for start, size in shares:
        assert start == offset
        offset += size
    assert offset == plan.global_batch_size
    assert max(s for _, s in shares) - min(s for _, s in shares) <= 1


def test_bad_memberships_are_refused() -> None:
    with pytest.raises(ValueError, match="2 workers but 1 nodes"):
        make_plan(1, ["a", "b"], ["n"], _cfg(0))
    with pytest.raises(ValueError, match="at least one worker"):
        make_plan(1, [], [], _cfg(0))


def test_state_bytes_follow_the_zero_partitioning() -> None:
    psi = 1_000_000
    whole = 4 * psi
    assert state_bytes_per_rank(zero_plan(0, 1, 4, 1), psi).total == 4 * whole
    s1 = state_bytes_per_rank(zero_plan(1, 1, 4, 1), psi)  # S = 2
    assert (s1.params, s1.grads, s1.optimizer) == (whole, whole, whole)
    s2 = state_bytes_per_rank(zero_plan(2, 1, 4, 1), psi)
    assert (s2.params, s2.grads, s2.optimizer) == (whole, whole // 2, whole)
    s3 = state_bytes_per_rank(zero_plan(3, 1, 8, 1), psi)  # S = 4
    assert (s3.params, s3.grads, s3.optimizer) == (whole // 4, whole // 4, whole // 2)
    degraded = state_bytes_per_rank(zero_plan(3, 1, 3, 1), psi)  # data parallel
    assert degraded.total == 4 * whole
    assert "MiB" in s3.describe()
