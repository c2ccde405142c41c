"""Starts one container inside its pod's namespaces; run by the pod runner, stdlib only.

    ip netns exec <pod netns> unshare --mount --propagation private \
        python -P hack/podrunner/launch.py <spec.json>

In the fresh mount namespace it bind-mounts each volume at its mountPath (creating the
mount point on the host's filesystem if missing: an empty directory or file), the pod's
hosts file over /etc/hosts, makes the root filesystem read-only when the container asks,
switches to the container's user and groups, and execs the command, so the process the
runner started is the container's process (signals reach it; its exit code is the
container's).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"pod runner: mount {' '.join(args)}: {result.stderr.strip()}")


_MS_BIND, _MS_REC = 4096, 16384
_libc = ctypes.CDLL(None, use_errno=True)


def _bind(source_fd: int, target: str) -> None:
    """Bind-mount an opened source: by descriptor, so an earlier mount (say, an emptyDir on
    /tmp) cannot hide a source path below it."""
    if _libc.mount(
        f"/proc/self/fd/{source_fd}".encode(), target.encode(), None, _MS_BIND | _MS_REC, None
    ):
        error = ctypes.get_errno()
        raise SystemExit(f"pod runner: bind onto {target}: {os.strerror(error)}")


def _user_files(uid: int, gid: int, directory: str) -> list[tuple[str, str]]:
    """/etc/passwd and /etc/group naming the container's user, as its image would."""
    files = []
    for name, line in (
        ("passwd", f"bulkhead:x:{uid}:{gid}::/tmp:/bin/sh"),
        ("group", f"bulkhead:x:{gid}:"),
    ):
        with open(f"/etc/{name}") as handle:
            text = handle.read()
        path = os.path.join(directory, name)
        with open(path, "w") as handle:
            handle.write(text.rstrip("\n") + "\n" + line + "\n")
        files.append((path, f"/etc/{name}"))
    return files


def _mount_point(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()


def _reveal(hidden: str, paths: list[str], stage_dir: str) -> None:
    """Make `paths` reachable under `hidden`, a directory other users may not enter (here
    /root, which holds the Python installation the virtualenv points to): a tmpfs replaces
    it in this mount namespace only, and the paths are bind-mounted back into it."""
    stages = []
    for index, path in enumerate(paths):
        stage = os.path.join(stage_dir, f"reveal-{index}")
        os.makedirs(stage, exist_ok=True)
        _mount("--bind", path, stage)
        stages.append((stage, path))
    _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", hidden)
    for stage, path in stages:
        os.makedirs(path, exist_ok=True)
        _mount("--bind", stage, path)


def main(spec_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    socket.sethostname(spec["hostname"])  # own UTS namespace: gloo binds what this resolves to
    for hidden, paths in (spec.get("reveal") or {}).items():
        _reveal(hidden, paths, os.path.dirname(spec_path))
    binds = [(m["source"], m["target"]) for m in spec["mounts"]] + [(spec["hosts"], "/etc/hosts")]
    if spec.get("uid"):
        binds += _user_files(
            spec["uid"], spec.get("gid") or spec["uid"], os.path.dirname(spec_path)
        )
    opened = [(os.open(source, os.O_PATH), target) for source, target in binds]
    for fd, target in opened:
        _mount_point(f"/proc/self/fd/{fd}", target)  # the source even if hidden by now
        _bind(fd, target)
        os.close(fd)
    if spec["readOnlyRoot"]:
        _mount("-o", "remount,bind,ro", "/")
        for mount in spec["mounts"]:  # remounting / must not take these with it
            if not mount["read_only"]:
                _mount("-o", "remount,bind,rw", mount["target"])
    for mount in spec["mounts"]:
        if mount["read_only"]:
            _mount("-o", "remount,bind,ro", mount["target"])
    env = spec["env"]
    argv = spec["argv"]
    program = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
    if spec.get("gid") is not None:
        os.setgroups(spec.get("groups") or [])
        os.setgid(spec["gid"])
    if spec.get("uid") is not None:
        os.setuid(spec["uid"])
    os.chdir(spec.get("workingDir") or "/")
    os.execvpe(program, argv, env)


if __name__ == "__main__":
    main(sys.argv[1])
