"""The `bulkhead` CLI: crd and validate, run as a real subprocess like a user would."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-P", "-m", "bulkhead.cli.main"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_crd_prints_committed_file():
    out = _run("crd")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (REPO / "crds/trainingjobs.bulkhead.dev.yaml").read_text()


def test_validate_examples_succeeds():
    examples = sorted(str(p) for p in REPO.glob("examples/*.yaml"))
    out = _run("validate", *examples)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": valid (") == len(examples)


def test_validate_reports_one_line_per_error_and_fails():
    out = _run(
        "validate",
        "tests/data/invalid/min-workers-above-workers.yaml",
        "tests/data/valid/minimal.yaml",
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "tests/data/invalid/min-workers-above-workers.yaml: spec.minWorkers: "
        "must be <= workers (got workers=2, minWorkers=3)"
    ]
    assert "minimal.yaml: valid (minimal)" in out.stdout


def test_validate_missing_file_is_a_clear_error():
    out = _run("validate", "does-not-exist.yaml")
    assert out.returncode == 1
    assert "does-not-exist.yaml: cannot read file" in out.stderr


def test_operator_and_agent_packages_do_not_import_torch():
    code = (
        "import sys, importlib, pkgutil\n"
        "import bulkhead.operator, bulkhead.agent, bulkhead.api\n"
        "for pkg in (bulkhead.operator, bulkhead.agent, bulkhead.api):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr


def test_unreadable_inputs_get_one_clear_line_and_no_traceback(tmp_path: Path) -> None:
    files = {
        "binary.yaml": (bytes(range(256)), "not UTF-8 text (byte 0x80 at offset 128)"),
        "latin1.yaml": ("workers: 2 # caf\xe9\n".encode("latin-1"), "not UTF-8 text"),
        "nul.yaml": (b"kind: TrainingJob\n\0\0", "binary file (contains NUL bytes)"),
        "broken.yaml": (b"spec: [\n", "invalid YAML at line 2, column 1:"),
        "huge.yaml": (b"#" * (5 << 20), "file larger than"),
    }
    for name, (content, expected) in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        for command in ("validate", "run", "plan"):
            out = _run(command, str(path))
            assert out.returncode != 0, (command, name)
            assert expected in out.stderr, (command, name, out.stderr)
            assert "Traceback" not in out.stderr, (command, name)
            assert len(out.stderr.strip().splitlines()) == 1, (command, name, out.stderr)
    directory = _run("validate", str(tmp_path))
    assert directory.returncode == 1 and "cannot read file" in directory.stderr


def test_validate_refuses_job_names_the_operator_cannot_use(tmp_path):
    minimal = (REPO / "tests/data/valid/minimal.yaml").read_text()
    paths = []
    for name in ("1job", "j" * 64):
        path = tmp_path / f"{name[:8]}.yaml"
        path.write_text(minimal.replace("name: minimal", f"name: {name}", 1))
        paths.append(str(path))
    out = _run("validate", *paths)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2, out.stderr
    assert all("metadata.name: a job name is a DNS-1035 label" in line for line in lines)
