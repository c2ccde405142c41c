"""The hang and partition rules, as pure functions of the state (and a timer tick).

A member is *silent* when the session has not heard from it (no report, no membership
poll) for a while; a poller is alive by definition (it may be blocked in a collective).
``PolicyActions.check_hang`` turns what these find into stops, losses and restarts.

A member is *cut off* when most members name it in their collective-error reports as a
peer they cannot reach (``trainer.runtime.probe``). A worker cut off from everyone names
every peer too, but is not believed; with two members nobody has a majority and the
silence rules decide.
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


def cut_off_members(s: LifecycleState) -> list[tuple[Slot, list[str]]]:
    """Members named unreachable by more than half of the generation's members, each
    with the members who named it (a strict majority: two members never decide).

    Only a member that reaches most of the others is believed: the cut-off worker, which
    names everyone, is not, and when most members name most others the network failed,
    not the workers, so nobody is evicted (that would only restart the job).
    """
    members = {s.ref(slot).id: slot for slot in s.slots if _is_member(s, slot)}
    named: dict[str, set[str]] = {}
    for accuser, accused in s.accusations:
        if accuser in members and accused in members and accuser != accused:
            named.setdefault(accuser, set()).add(accused)
    believed = {a for a, xs in named.items() if 2 * len(xs) <= len(members) - 1}
    out = []
    for wid, slot in members.items():
        accusers = sorted(a for a in believed if wid in named[a])
        if 2 * len(accusers) > len(members):
            out.append((slot, accusers))
    return out if 2 * len(out) < len(members) else []
