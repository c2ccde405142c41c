"""Finding and running the control-plane binaries: etcd, kube-apiserver, scheduler, kwok, ...

This is the process layer under hack/k8s_cluster.py: where the binaries are (the build cache
of hack/build-k8s.sh, or $BULKHEAD_K8S_BIN / $KUBEBUILDER_ASSETS), free loopback ports,
starting a component with its output in a log file, waiting until it answers its health
endpoint, and stopping it. It knows nothing of Kubernetes objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import pathlib
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

HACK_DIR = pathlib.Path(__file__).resolve().parent
BUILD_SCRIPT = HACK_DIR / "build-k8s.sh"
SERVER_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
PR_SET_PDEATHSIG = 1


class BinariesMissing(RuntimeError):
    """A control-plane binary is not built; the message says how to build it."""


class ComponentError(RuntimeError):
    """A component exited or did not become healthy in time; the message has its log tail."""


def pinned_k8s_version() -> str:
    """The Kubernetes release pinned in build-k8s.sh (the single place versions are set)."""
    match = re.search(r"^K8S_VERSION=(\S+)$", BUILD_SCRIPT.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no K8S_VERSION= line in {BUILD_SCRIPT}")
    return match.group(1)


def cache_bin_dir() -> pathlib.Path:
    root = os.environ.get("BULKHEAD_K8S_CACHE") or pathlib.Path.home() / ".cache" / "bulkhead"
    return pathlib.Path(root) / f"k8s-{pinned_k8s_version()}" / "bin"


def search_dirs() -> list[pathlib.Path]:
    """Where binaries are looked up, first match wins (same order as build-k8s.sh)."""
    dirs = [os.environ.get("BULKHEAD_K8S_BIN"), os.environ.get("KUBEBUILDER_ASSETS")]
    return [pathlib.Path(d) for d in dirs if d] + [cache_bin_dir()]


def find_binary(name: str, *, use_path: bool = False) -> pathlib.Path | None:
    for directory in search_dirs():
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name) if use_path else None
    return pathlib.Path(found) if found else None


def find_binaries() -> dict[str, pathlib.Path]:
    """Every binary the cluster needs (servers and the pinned kubectl, never one on PATH);
    raises BinariesMissing."""
    found: dict[str, pathlib.Path] = {}
    missing: list[str] = []
    for name in (*SERVER_BINARIES, "kubectl"):
        path = find_binary(name)
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if missing:
        looked = ", ".join(str(d) for d in search_dirs())
        raise BinariesMissing(
            f"Kubernetes test binaries missing: {', '.join(missing)} (looked in {looked}). "
            "Run `make k8s` (hack/build-k8s.sh) once to build them into the cache, or point "
            "BULKHEAD_K8S_BIN at a directory that holds them."
        )
    return found


def free_port() -> int:
    """A loopback port free right now; callers retry on the rare race with another process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child of a fork should only call


def _die_with_parent() -> None:
    # Runs in the child before exec: a test session killed hard must not leak an API server.
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def tail(path: pathlib.Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


@dataclasses.dataclass
class Component:
    """One running control-plane process and its log file."""

    name: str
    pid: int
    log_path: pathlib.Path
    popen: subprocess.Popen[bytes] | None = None  # None when attached from a state file

    @classmethod
    def start(
        cls,
        name: str,
        argv: Sequence[str],
        log_dir: pathlib.Path,
        *,
        detach: bool,
        env: dict[str, str] | None = None,
    ) -> Component:
        """Start argv with stdout+stderr appended to log_dir/<name>.log.

        detach=True (for `make cluster`) lets the process outlive this Python process;
        otherwise it is killed when the parent dies.
        """
        log_path = log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            out.write(f"\n==== starting: {' '.join(argv)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if detach else _die_with_parent,
                env={**os.environ, **(env or {})},
            )
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return cls(name=name, pid=popen.pid, log_path=log_path, popen=popen)

    def exit_code(self) -> int | None:
        """The exit status if it has ended, else None."""
        if self.popen is not None:
            return self.popen.poll()
        return None if _pid_alive(self.pid) else -1

    def wait_healthy(self, probe: Callable[[], bool], timeout: float) -> None:
        """Poll probe until it is true; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise ComponentError(
                    f"{self.name} exited with status {code} while starting; last log lines:\n"
                    f"{tail(self.log_path)}"
                )
            with contextlib.suppress(OSError, ValueError):
                if probe():
                    log.info("%s is healthy", self.name)
                    return
            time.sleep(0.2)
        raise ComponentError(
            f"{self.name} not healthy after {timeout:.0f} s; last log lines:\n{tail(self.log_path)}"
        )

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM); see wait_stopped."""
        if self.exit_code() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def wait_stopped(self, timeout: float) -> None:
        """Wait for exit after terminate(); SIGKILL when it takes longer than timeout."""
        deadline = time.monotonic() + timeout
        while self.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.exit_code() is None:
            log.warning(
                "%s (pid %d) ignored SIGTERM for %.0f s; killing", self.name, self.pid, timeout
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            if self.popen is not None:
                self.popen.wait(timeout=10)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it has exited for our purposes.
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def pid_runs(pid: int, binary: pathlib.Path) -> bool:
    """True when pid is alive and runs binary (guards `down` against reused pids)."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return _pid_alive(pid) and os.fsdecode(cmdline) == str(binary)


def http_ok(
    url: str, context: ssl.SSLContext | None = None, expect: str | None = None, timeout: float = 3
) -> bool:
    """True when url answers 200 (and its body contains expect, if given)."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as response:
            body = response.read().decode(errors="replace")
            return response.status == 200 and (expect is None or expect in body)
    except urllib.error.URLError:
        return False


def insecure_tls() -> ssl.SSLContext:
    """For the health ports of scheduler/controller-manager, which serve self-signed certs."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
