"""The image recipe agrees with the project: every process the Dockerfile, the manifests,
the chart and the operator's pod builder start is a console script of pyproject.toml that
the install provides and that runs; the image installs from constraints.txt; the CPU
variant pins the same torch; every file the package build reads is copied in."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from bulkhead.operator.k8s import builders

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
VENV_BIN = Path(sys.executable).parent


def _commands_in_manifests() -> set[str]:
    found = set()
    for path in [*(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "charts").rglob("*.yaml")]:
        for match in re.finditer(r"^\s*command:\s*\[\s*\"?([\w-]+)", path.read_text(), re.M):
            found.add(match.group(1))
    return found


def entry_points() -> set[str]:
    """Every program an image user or a manifest starts."""
    cmd = re.search(r'^CMD \["([\w-]+)"', DOCKERFILE, re.M)
    assert cmd, "the Dockerfile has no exec-form CMD"
    return {
        cmd.group(1),
        *_commands_in_manifests(),
        builders.WORKER_COMMAND[0],
        builders.CHECKPOINTD_COMMAND[0],
    }


def test_entry_points_are_console_scripts() -> None:
    points = entry_points()
    assert points >= {"bulkhead-operator", "bulkhead-agent", "bulkhead-worker",
                      "bulkhead-checkpointd"}  # fmt: skip
    assert points <= set(SCRIPTS), points - set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_scripts_are_installed_and_start(script: str) -> None:
    path = VENV_BIN / script
    assert path.is_file(), f"{script} is not installed in {VENV_BIN}"
    result = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=120)
    # It imports and starts: it prints its usage, or (bulkhead-worker, configured by the
    # operator through the environment) names the settings it lacks; never a traceback.
    assert "Traceback" not in result.stderr, result.stderr
    if script == "bulkhead-worker":
        assert result.returncode == 2 and "BULKHEAD_CONTROL_URL" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert "usage" in result.stdout.lower()


def test_image_installs_from_constraints() -> None:
    installs = re.findall(r"pip install ([^\n\\]*)", DOCKERFILE)
    project_install = [i for i in installs if '".[all]"' in i]
    assert project_install and all("-c constraints.txt" in i for i in project_install)
    assert re.search(r"^COPY constraints\.txt ", DOCKERFILE, re.M)


def test_cpu_variant_takes_the_pinned_torch() -> None:
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if re.match(r"^torch==", line)]  # fmt: skip
    assert len(pins) == 1, pins
    assert "grep -E '^torch==' constraints.txt" in DOCKERFILE
    assert "ARG VARIANT=cuda" in DOCKERFILE


def test_every_file_the_build_reads_is_copied() -> None:
    copied = set()
    for line in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M):
        copied.update(p.rstrip("/") for p in line.split())
    setup = (ROOT / "setup.py").read_text()
    roots = re.search(r"ROOTS = \(([^)]*)\)", setup)
    assert roots
    needed = {r.strip().strip('"') for r in roots.group(1).split(",") if r.strip()}
    needed |= {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]}
    needed |= set(PYPROJECT["project"].get("license-files", []))
    assert needed <= copied, needed - copied


def test_manifests_run_the_image_the_chart_names() -> None:
    values = yaml.safe_load((ROOT / "charts" / "bulkhead" / "values.yaml").read_text())
    assert values["image"]["repository"] in DOCKERFILE


def test_every_base_image_is_pinned_by_digest() -> None:
    """A tag moves; a digest names the bytes that were tested."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE, re.M))
    bases = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    assert bases
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"FROM {base} is not pinned: {image}"
