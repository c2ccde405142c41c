"""The hang rules of a timer tick, as pure functions of the state and the tick.

A member is *silent* when the session has not heard from it (no report, no membership
poll) for a while; a poller is alive by definition (it may be blocked in a collective).
``PolicyActions.check_hang`` turns what these find into stops, losses and restarts.
"""

from __future__ import annotations

from bulkhead.operator.lifecycle.types import LifecycleState, Slot, Tick


def _is_member(s: LifecycleState, slot: Slot) -> bool:
    return s.ref(slot).id in s.member_ids()


def lone_silent_member(s: LifecycleState, ev: Tick, now: float) -> Slot | None:
    """The one member that neither reported a collective error nor polls membership,
    silent for the grace, while at least one other member reported a collective error
    in this generation; None unless exactly one member fits."""
    if not s.collective_errors:
        return None
    members = [slot for slot in s.slots if _is_member(s, slot)]
    silent = [
        slot
        for slot in members
        if s.ref(slot).id not in s.collective_errors and s.ref(slot).id not in ev.polling
    ]
    if len(members) < 2 or len(silent) != 1:
        return None
    (slot,) = silent
    last_seen = ev.last_seen.get(s.ref(slot).id, s.last_progress_at)
    return slot if now - last_seen >= s.config.suspect_grace_s else None


def silent_members(s: LifecycleState, ev: Tick, now: float) -> list[Slot]:
    """Members silent for half the hang timeout while training stalled (hang suspects)."""
    quiet_for = s.config.hang_timeout_s / 2
    return [
        slot
        for slot in s.slots
        if _is_member(s, slot)
        and s.ref(slot).id not in ev.polling  # a poller is alive by definition
        and now - ev.last_seen.get(s.ref(slot).id, s.last_progress_at) >= quiet_for
    ]
