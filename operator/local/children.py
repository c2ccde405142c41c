"""Child processes that end with their parent: on SIGTERM, SIGINT and on exit.

``end_children_on_exit()`` is called once by ``bulkhead run`` and by every bench before it
starts anything. From then on the process leads a process group (unless it is a shell
script's foreground job, where leaving the group would cut it off from the terminal's
Ctrl-C) and on SIGTERM, SIGINT or exit it ends its children: every other process of its
group, every descendant, and every process group registered with ``track`` (children
started in a session of their own, such as ``bulkhead run``'s workers, so that each can be
killed as one). They get SIGTERM (and SIGCONT, for a stopped one), ``grace_s`` to exit,
then SIGKILL. A bench ended by a timeout thus leaves no trainer running behind it.

After ending the children a signal ends the process as it would have: SIGINT raises
``KeyboardInterrupt`` and SIGTERM ``SystemExit(143)``, so ``finally`` blocks still run,
within ``EXIT_DEADLINE_S``: a cleanup that waits on an ended child cannot hang the exit.
Linux only (it reads ``/proc``). No torch here: the operator imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

_state: dict[str, object] = {"pid": None, "grace_s": 5.0}
EXIT_DEADLINE_S = 15.0  # after a signal, cleanup may take this long before the process exits
_tracked: set[int] = set()  # process group ids of children in sessions of their own


def end_children_on_exit(grace_s: float = 5.0) -> None:
    """Lead a process group and end every child on SIGTERM, SIGINT and exit (idempotent)."""
    _state["grace_s"] = grace_s
    if _state["pid"] == os.getpid():
        return
    _state["pid"] = os.getpid()
    if os.getpgrp() != os.getpid() and not _terminal_foreground():
        os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    atexit.register(end_children)


def track(pgid: int) -> None:
    """Also end process group ``pgid`` (a child started with ``start_new_session``)."""
    _tracked.add(pgid)


def untrack(pgid: int) -> None:
    _tracked.discard(pgid)


def end_children() -> None:
    """SIGTERM every child, wait up to the grace period, SIGKILL what is left."""
    if _state["pid"] != os.getpid():
        return  # a forked child inherited the registration: its parent does the ending
    for pgid in list(_tracked):
        _killpg(pgid, signal.SIGTERM)
        _killpg(pgid, signal.SIGCONT)
    left = children()
    for pid in left:
        # One that ignores SIGTERM (multiprocessing's resource tracker) would only make
        # the wait last the whole grace period: it is killed at once.
        _kill(pid, signal.SIGKILL if _ignores_sigterm(pid) else signal.SIGTERM)
        _kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + float(_state["grace_s"])  # type: ignore[arg-type]
    while (left or _tracked_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = children()
    for pgid in list(_tracked):
        _killpg(pgid, signal.SIGKILL)
    for pid in children():
        _kill(pid, signal.SIGKILL)
    _tracked.clear()


def children() -> list[int]:
    """Live pids of this process's group (other than itself) and of its descendants."""
    return family(os.getpid())


def family(me: int) -> list[int]:
    """Live pids of process group ``me`` (but ``me``) and of the descendants of ``me``."""
    table = _process_table()
    ours = {pid for pid, (_, pgrp) in table.items() if pgrp == me and pid != me}
    parents: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        parents.setdefault(ppid, []).append(pid)
    stack = [me]
    while stack:
        for child in parents.get(stack.pop(), []):
            if child not in ours:
                ours.add(child)
                stack.append(child)
    return sorted(ours)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    if _state["pid"] != os.getpid():
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    end_children()
    # The exception below runs the program's finally blocks and exit handlers; one of them
    # may wait for a child just ended (multiprocessing.Pool's terminate waits on a queue
    # lock a killed worker held, for ever). A deadline bounds that wait.
    watchdog = threading.Timer(EXIT_DEADLINE_S, os._exit, (128 + signum,))
    watchdog.daemon = True
    watchdog.start()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def group_members(pgid: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process of group ``pgid``, zombies too."""
    out = {}
    for pid, (ppid, pgrp, state) in _stat_table().items():
        if pgrp == pgid:
            out[pid] = (ppid, state)
    return out


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live process but zombies."""
    return {pid: (ppid, pgrp) for pid, (ppid, pgrp, state) in _stat_table().items() if state != "Z"}


def _stat_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return out


def _ignores_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def _tracked_alive() -> bool:
    return any(pgrp in _tracked for _, pgrp in _process_table().values())


def _terminal_foreground() -> bool:
    """Whether this process's group is a terminal's foreground job (Ctrl-C reaches it)."""
    try:
        with open("/dev/tty") as tty:
            return os.tcgetpgrp(tty.fileno()) == os.getpgrp()
    except OSError:
        return False


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
