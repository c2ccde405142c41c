"""The bulkhead-worker entry point: launch environment, user errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bulkhead.api.protocol import (
    ENDPOINT_ENV,
    INCARNATION_ENV,
    JOB_ENV,
    JOB_SPEC_ENV,
    LOCAL_RANK_ENV,
    POD_LAUNCHER_ENV,
    RUN_DIR_ENV,
    TOKEN_ENV,
    WORKER_ENV,
    WorkerExit,
)
from bulkhead.trainer.worker import is_pod_launcher, raised_inside, read_env, run


class _Recorder(BaseHTTPRequestHandler):
    posts: list[tuple[str, dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.posts.append((self.path, body))
        reply = json.dumps({"action": "stop", "generation": 0, "reason": "failed"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def control() -> Iterator[tuple[str, list[tuple[str, dict]]]]:
    _Recorder.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _Recorder.posts
    server.shutdown()


def _env(url: str, spec: dict) -> dict[str, str]:
    return {
        ENDPOINT_ENV: url,
        TOKEN_ENV: "t0k",
        JOB_ENV: "demo",
        WORKER_ENV: "demo-w0-0",
        INCARNATION_ENV: "0",
        JOB_SPEC_ENV: json.dumps(spec),
    }


def test_launch_env_is_read_and_validated(tmp_path: Path) -> None:
    env = {**_env("http://x", {"workers": 1}), RUN_DIR_ENV: str(tmp_path)}
    launch = read_env(env)
    assert (launch.worker, launch.incarnation, launch.run_dir) == ("demo-w0-0", 0, tmp_path)
    assert launch.advertise_host == "127.0.0.1"
    with pytest.raises(ValueError, match=JOB_SPEC_ENV):
        read_env({k: v for k, v in env.items() if k != JOB_SPEC_ENV})
    with pytest.raises(ValueError, match=INCARNATION_ENV):
        read_env({**env, INCARNATION_ENV: "first"})


def test_bad_spec_is_a_user_error_reported_to_the_manager(control) -> None:
    url, posts = control
    spec = {"workers": 2, "trainer": {"model": {"dModel": 64, "nHeads": 5}}}
    assert run(_env(url, spec)) == WorkerExit.USER_ERROR
    assert len(posts) == 1
    path, body = posts[0]
    assert path == "/v1/jobs/demo/faults"
    assert body["kind"] == "user_error" and body["worker"] == "demo-w0-0"
    assert "nHeads" in body["message"]


def test_missing_data_is_a_user_error(control) -> None:
    url, posts = control
    spec = {"workers": 1, "trainer": {"data": {"source": "/nonexistent/*.txt"}}}
    assert run(_env(url, spec)) == WorkerExit.USER_ERROR
    assert posts and "no text files" in posts[0][1]["message"]


def test_entry_point_exits_2_on_an_incomplete_environment() -> None:
    code = "from bulkhead.trainer.worker import main; main()"
    done = subprocess.run(
        [sys.executable, "-P", "-c", code],
        env={"PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == WorkerExit.USER_ERROR
    assert "missing environment variables" in done.stderr


def test_a_value_error_from_inside_torch_is_not_a_user_error_by_itself() -> None:
    """Where the error was raised decides: our checks and user code (user errors) or the
    depths of torch (replace the worker, bounded by maxRestarts)."""
    import torch
    import torch.nn.functional as F

    torch_dir = Path(torch.__file__).resolve().parent
    with pytest.raises(ValueError) as inside:
        F.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    assert raised_inside(inside.value, torch_dir)
    with pytest.raises(ValueError) as ours:
        read_env({})  # a check of our own
    assert not raised_inside(ours.value, torch_dir)


def test_a_kubernetes_pod_of_one_process_runs_the_launcher_and_local_mode_does_not() -> None:
    env = _env("http://127.0.0.1:1", {"workers": 1})
    launch = read_env(env)
    assert is_pod_launcher(launch, 1, {**env, POD_LAUNCHER_ENV: "1"})  # Kubernetes
    assert not is_pod_launcher(launch, 1, env)  # local mode: its driver keeps the template
    assert is_pod_launcher(launch, 2, env)  # several processes: always
    process = read_env({**env, POD_LAUNCHER_ENV: "1", LOCAL_RANK_ENV: "0"})
    assert not is_pod_launcher(process, 1, {**env, POD_LAUNCHER_ENV: "1"})  # its process
