"""The lease decision (pure): who may take the lease, judged by the candidate's own clock."""

from __future__ import annotations

import pytest

from bulkhead.operator.k8s.leader import ElectionSettings, LeaseRecord, decide


def lease(holder: str, renew: str = "t1", duration: float = 15) -> LeaseRecord:
    return LeaseRecord(holder=holder, duration_s=duration, renew_time=renew, transitions=0)


def test_no_lease_is_created_and_our_own_is_renewed() -> None:
    assert decide(None, "a", None, 0.0, 100.0) == "create"
    held = lease("a")
    assert decide(held, "a", held, 0.0, 1000.0) == "renew"


def test_a_live_holder_is_waited_for_until_its_record_stops_changing_for_the_duration() -> None:
    held = lease("b", renew="t1")
    # First sight of this record: the clock starts now, whatever the record's timestamps say.
    assert decide(held, "a", None, 0.0, 100.0) == "wait"
    assert decide(held, "a", held, 100.0, 114.9) == "wait"
    assert decide(held, "a", held, 100.0, 115.0) == "take"
    # The holder renewed (the record changed): the clock starts again.
    renewed = lease("b", renew="t2")
    assert decide(renewed, "a", held, 100.0, 130.0) == "wait"


def test_a_released_lease_is_taken_at_once() -> None:
    released = lease("", duration=1)
    assert decide(released, "a", None, 0.0, 5.0) == "take"


@pytest.mark.parametrize(("retry", "deadline", "duration"), [(2, 10, 10), (0, 1, 2), (3, 2, 15)])
def test_settings_must_leave_the_leader_time_to_step_down_before_the_lease_ends(
    retry: float, deadline: float, duration: float
) -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        ElectionSettings("ns", "lease", "a", duration, deadline, retry)
