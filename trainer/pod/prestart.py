"""Pre-started trainer processes: one template imports once, every process is forked from it.

A template (``bulkhead.trainer.worker.template_main``) imports torch and the trainer once
(the 4-6 CPU seconds of a cold start), starts no thread, then serves fork requests: each
request (one JSON line on its stdin: a launch environment) becomes a process forked from
it in milliseconds that runs the trainer that environment names. Local mode's driver keeps
one template for its worker "pods", a pod's launcher one for its trainer processes; both
start it with ``template_command`` through ``ForkServer`` and ask it for processes with
``ForkServer.fork``.

Who reaps a forked process: its requester, as if it had started it. The template forks
twice and the intermediate process exits at once, so the process is re-parented to the
requester, which made itself a child subreaper (``become_subreaper``); the process then
dies with the requester (``die_with_parent``), and it is a real child of the requester:
its exit (a ``kill -9`` too) and its exit code are the kernel's, not relayed, and a
killed template takes none of them with it. A killed requester takes the template (it
dies with its parent) and every forked process with it: nothing is left behind.

The template's imports take seconds of CPU that a start or a recovery needs: where the
starter can give a process its priority back (``can_renice_back``), it starts the template
at a lower one and gives each forked process its own priority back.
No torch here: the operator's local driver imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, NoReturn

from bulkhead.api.protocol import LOCAL_RANK_ENV, LOG_FILE_ENV, WORKER_ENV

# Carried in a fork request beside the environment, never into it: when (wall clock, the
# requester's and the process's, on one machine) the process was asked for. A request made
# before the template's imports were done counts its process's start from then.
HANDED_OVER_AT = "BULKHEAD_HANDED_OVER_AT"
# How long a request may wait for the template (its imports, under load).
FORK_TIMEOUT_S = 300.0

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int | bytes) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def die_with_parent() -> None:
    """SIGKILL me when my parent dies (Linux): a supervisor, launcher or template that was
    killed leaves no process behind. Called in a child before exec, or after a fork."""
    with contextlib.suppress(Exception):
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def become_subreaper(enabled: bool = True) -> None:
    """Make this process adopt its descendants' orphans (PR_SET_CHILD_SUBREAPER, Linux >=
    3.4): the processes a template forks for it become its children. ``enabled=False``
    gives orphans back to init (a test process that hosted a driver and runs on)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, int(enabled))


def process_name(local_rank: int) -> bytes:
    """The name (``/proc/PID/comm``) of a forked trainer process of local rank ``local_rank``:
    /proc shows a forked process the template's environment, not its own."""
    return f"bulkhead-rank{local_rank}".encode()[:15]


def template_command() -> list[str]:
    """A template that imports the trainer once and forks trainer processes on request."""
    return [sys.executable, "-P", "-c", "from bulkhead.trainer.worker import template_main; "
            "template_main()"]  # fmt: skip


def can_renice_back() -> bool:
    """Whether this process may give a child whose priority it lowered its own back
    (setpriority(2): root, or RLIMIT_NICE allowing this process's nice value)."""
    if os.geteuid() == 0:
        return True
    allowed = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return allowed == resource.RLIM_INFINITY or 20 - allowed <= os.getpriority(os.PRIO_PROCESS, 0)


# ------------------------------------------------------------------ the requester's side


class Forked:
    """A process the template forked for this process (its child once adopted): the part
    of ``subprocess.Popen`` the drivers use (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        """The exit code (negative: the signal), reaping it; None while it runs."""
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not (or no longer) ours: cannot be waited for
                self._code = 255
            else:
                if pid:
                    self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, waiting up to ``timeout`` (``subprocess.TimeoutExpired`` after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            fd = self.exited_fd()
        except OSError:  # no pidfds here (Linux < 5.3): poll
            fd = None
        try:
            while (code := self.poll()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
                if fd is not None:
                    select.select([fd], [], [], left)  # readable once it has exited
                else:
                    time.sleep(0.01)
        finally:
            if fd is not None:
                os.close(fd)
        return code

    def exited_fd(self) -> int | None:
        """A pidfd, readable once the process has exited (an event loop watches it); None
        when it is already gone. The caller closes it."""
        try:
            return os.pidfd_open(self.pid)
        except ProcessLookupError:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class TemplateGone(RuntimeError):
    """The template exited, or did not answer a request in time."""


class ForkServer:
    """A template process and the requests to it: ``fork(env)`` returns a process running
    the trainer ``env`` describes, a child of this process (which becomes a subreaper)."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        command: list[str] | None = None,
        nice: int = 0,
        new_sessions: bool = False,
        stderr: IO[bytes] | int | None = None,
    ) -> None:
        become_subreaper()
        self.nice = nice
        # Each forked process leads a session of its own (local mode: a worker "pod" is a
        # process group killed as one); else it stays in this process's group.
        self.new_sessions = new_sessions
        self.process = subprocess.Popen(
            command or template_command(),
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            preexec_fn=lambda: _lowered_child(nice),
        )
        self.ready_at: float | None = None  # time.monotonic() when its imports were done
        self.threads: int | None = None  # its threads then (1: nothing lost in a fork)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def ready(self) -> bool:
        """Whether its imports are done (reads its answer without waiting; a request under
        way reads it meanwhile)."""
        if self.ready_at is None and self._lock.acquire(blocking=False):
            try:
                if self._readable(0.0):
                    self._read_line(0.0)
            except TemplateGone:
                pass
            finally:
                self._lock.release()
        return self.ready_at is not None

    def fork(self, env: Mapping[str, str], timeout_s: float = FORK_TIMEOUT_S) -> Forked:
        """A process forked from the template running the trainer of ``env``, given this
        process's priority; waits for the template's imports when they are not done."""
        request = {
            "env": dict(env),
            "parent": os.getpid(),
            "session": self.new_sessions,
            HANDED_OVER_AT: time.time(),
        }
        with self._lock:
            if self.process.stdin is None or not self.alive():
                raise TemplateGone(f"template {self.pid} exited")
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise TemplateGone(f"template {self.pid} exited") from exc
            deadline = time.monotonic() + timeout_s
            while True:
                words = self._read_line(deadline - time.monotonic())
                if words[0] == "forked":
                    break
                if words[0] == "failed":
                    raise TemplateGone(f"template {self.pid}: {' '.join(words[1:])}")
        forked = Forked(int(words[1]))
        if self.nice:  # from now on it is a trainer process: this process's priority
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, forked.pid, os.getpriority(os.PRIO_PROCESS, 0))
        return forked

    def signal(self, sig: int) -> None:
        """Signal the template (SIGSTOP/SIGCONT: its imports wait while a recovery runs)."""
        with contextlib.suppress(ProcessLookupError):
            if self.alive():
                self.process.send_signal(sig)

    def close(self) -> None:
        """End the template (the processes it forked are not its: they keep running)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        with self._lock:  # a request under way ends first (TemplateGone: its pipe's end)
            for pipe in (self.process.stdin, self.process.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()

    def _readable(self, timeout_s: float) -> bool:
        assert self.process.stdout is not None
        return bool(select.select([self.process.stdout], [], [], max(0.0, timeout_s))[0])

    def _read_line(self, timeout_s: float) -> list[str]:
        """The template's next answer (``ready``, ``forked PID``, ``failed WHY``)."""
        assert self.process.stdout is not None
        if not self._readable(timeout_s):
            raise TemplateGone(f"template {self.pid} did not answer in time")
        line = self.process.stdout.readline().decode()
        if not line:
            raise TemplateGone(f"template {self.pid} exited")
        words = line.split()
        if words[0] == "ready":
            self.ready_at = time.monotonic()
            self.threads = int(words[1])
            return self._read_line(timeout_s) if timeout_s > 0 else words
        return words


def _lowered_child(nice: int) -> None:
    """In a template before exec: die with its starter, run ``nice`` lower."""
    die_with_parent()
    if nice:
        os.nice(nice)


# ------------------------------------------------------------------ the template's side


def serve_forks(
    imports: Callable[[], None], become: Callable[[dict[str, str], float], NoReturn]
) -> NoReturn:
    """The template: ``imports()``, then for each request on stdin fork a process that
    calls ``become(env, handed_over)`` (``handed_over``: ``time.monotonic()`` of the
    request); exit 3 at the end of input (nobody needs it any more)."""
    # Its stdout is the channel to the requester: whatever else prints goes to stderr.
    channel = os.dup(1)
    os.dup2(2, 1)
    imports()
    ready = time.monotonic()
    threads = len(os.listdir("/proc/self/task"))
    # A fork copies only the calling thread: a pool started before it would be missing in
    # the child, holding whatever locks it held (torch's intra-op pool, OpenMP, BLAS).
    print(f"template {os.getpid()} ready ({threads} thread(s))", file=sys.stderr, flush=True)
    os.write(channel, f"ready {threads}\n".encode())
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        request = json.loads(line)
        intermediate = os.fork()
        if intermediate == 0:
            try:
                _fork_adopted(request, channel, become, ready)
            finally:
                os._exit(0)
        os.waitpid(intermediate, 0)
    os._exit(3)


def _fork_adopted(
    request: dict[str, Any],
    channel: int,
    become: Callable[[dict[str, str], float], NoReturn],
    ready: float,
) -> None:
    """In the intermediate process: fork the process and exit, so that the process is
    re-parented to the requester (a subreaper); in the process: wait for that, answer the
    request with its pid, then become the trainer (in a session of its own when asked)."""
    me = os.getpid()
    if os.fork() != 0:
        os._exit(0)
    while os.getppid() == me:  # the intermediate process is exiting
        time.sleep(0.0002)
    die_with_parent()
    if os.getppid() != request["parent"]:  # the requester died, or is not a subreaper
        os.write(channel, f"failed {os.getpid()} not adopted by {request['parent']}\n".encode())
        os._exit(1)
    if request["session"]:
        os.setsid()
    env = {str(k): str(v) for k, v in request["env"].items()}
    if env.get(LOCAL_RANK_ENV):  # its environment block is the template's: its name says
        with contextlib.suppress(OSError):
            _prctl(_PR_SET_NAME, process_name(int(env[LOCAL_RANK_ENV])))
    # Its start counts from the request: one made before the imports were done waited.
    waited = time.time() - float(request[HANDED_OVER_AT])
    handed_over = time.monotonic() - max(0.0, waited)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the template's requests are not its input
    os.close(null)
    if env.get(LOG_FILE_ENV):  # from now on this process is that worker: its log
        log = os.open(env[LOG_FILE_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.write(channel, f"forked {os.getpid()}\n".encode())
    os.close(channel)  # the template's: it must not outlive the template in this process
    print(
        f"pre-started process {os.getpid()} runs {env.get(WORKER_ENV, '?')} "
        + (
            f"(imports done {handed_over - ready:.1f}s before)"
            if ready <= handed_over
            else f"(handed over before its imports were done: {ready - handed_over:.1f}s later)"
        ),
        file=sys.stderr,
        flush=True,
    )
    become(env, handed_over)
