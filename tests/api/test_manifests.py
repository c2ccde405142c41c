"""TrainingJob models: examples and valid manifests pass; each invalid one names its field."""

from pathlib import Path

import pytest

from bulkhead.api import ManifestError, load_job, parse_spec
from bulkhead.api.spec import TrainingJobSpec

REPO = Path(__file__).resolve().parents[2]
VALID = sorted([*REPO.glob("examples/*.yaml"), *REPO.glob("tests/data/valid/*.yaml")])
INVALID = sorted(REPO.glob("tests/data/invalid/*.yaml"))


def _expected_field(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path} must start with '# expect: <field>'"
    return first.removeprefix("# expect: ").strip()


def test_there_are_cases():
    assert len(VALID) >= 3 and len(INVALID) >= 10


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_manifest_loads(path: Path):
    job = load_job(path)
    assert job.spec.workers >= job.spec.min_workers


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_manifest_names_its_field(path: Path):
    with pytest.raises(ManifestError) as info:
        load_job(path)
    fields = [e.field for e in info.value.errors]
    assert fields == [_expected_field(path)], str(info.value)
    assert all(e.message for e in info.value.errors)


def test_defaults_are_filled():
    spec = parse_spec({"workers": 3})
    assert spec.min_workers == 1
    assert spec.fault_tolerance.max_failures == 0
    assert spec.checkpoint.interval_steps == 50
    assert spec.trainer.model.moe is None
    assert spec.fault_tolerance.evict_severities == ["critical"]


def test_wire_round_trip_uses_camel_case():
    spec = parse_spec({"workers": 4, "minWorkers": 2, "faultTolerance": {"maxFailures": 1}})
    wire = spec.wire()
    assert wire["minWorkers"] == 2 and wire["faultTolerance"]["maxFailures"] == 1
    assert TrainingJobSpec.model_validate(wire) == spec


def test_cross_field_message_quotes_both_values():
    with pytest.raises(ManifestError) as info:
        parse_spec({"workers": 2, "minWorkers": 5})
    (err,) = info.value.errors
    assert err.field == "spec.minWorkers"
    assert "2" in err.message and "5" in err.message


def test_several_errors_are_all_reported():
    with pytest.raises(ManifestError) as info:
        parse_spec({"workers": 0, "checkpoint": {"keep": 0}, "bogus": 1})
    assert {e.field for e in info.value.errors} == {
        "spec.workers",
        "spec.checkpoint.keep",
        "spec.bogus",
    }


def test_unreadable_and_malformed_files(tmp_path: Path):
    with pytest.raises(ManifestError, match="cannot read file"):
        load_job(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(ManifestError, match="invalid YAML"):
        load_job(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ManifestError, match="must be a mapping"):
        load_job(scalar)
