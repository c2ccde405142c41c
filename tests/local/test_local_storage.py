"""Where local mode keeps checkpoints: under the run directory unless the job says otherwise."""

from __future__ import annotations

from pathlib import Path

from bulkhead.api.manifest import parse_spec
from bulkhead.operator.local.runner import LOCAL_CHECKPOINTS, prepare_run_dir, with_local_storage


def _spec(checkpoint: dict | None = None):
    wire = {"workers": 2, "checkpoint": checkpoint or {"intervalSteps": 7}}
    return parse_spec(wire, source="test")


def test_storage_defaults_to_an_absolute_path_under_the_run_dir(tmp_path: Path) -> None:
    spec = with_local_storage(_spec(), tmp_path / "run" / LOCAL_CHECKPOINTS)
    assert spec.checkpoint.storage.path == str((tmp_path / "run" / "checkpoints").resolve())
    assert spec.checkpoint.interval_steps == 7  # the rest of the spec is kept


def test_a_storage_path_named_by_the_job_is_kept(tmp_path: Path) -> None:
    spec = _spec({"storage": {"path": "/data/ckpt"}})
    assert with_local_storage(spec, tmp_path).checkpoint.storage.path == "/data/ckpt"


def test_a_pvc_means_the_run_dir_on_one_machine(tmp_path: Path) -> None:
    spec = with_local_storage(_spec({"storage": {"pvc": "ckpt"}}), tmp_path / "c")
    assert spec.checkpoint.storage.pvc is None
    assert spec.checkpoint.storage.path == str((tmp_path / "c").resolve())


def test_a_previous_runs_checkpoints_are_removed(tmp_path: Path) -> None:
    old = tmp_path / LOCAL_CHECKPOINTS / "job" / "step-000000000009"
    old.mkdir(parents=True)
    (old / "dp.manifest.json").write_text("{}")
    prepare_run_dir(tmp_path)
    assert not (tmp_path / LOCAL_CHECKPOINTS).exists()
