"""Load and validate TrainingJob manifests; turn pydantic errors into one precise line each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from bulkhead.api.spec import TrainingJob, TrainingJobSpec


@dataclass(frozen=True)
class FieldError:
    """One problem in a manifest: the dotted field path and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class ManifestError(ValueError):
    """A manifest that is not a valid TrainingJob; ``errors`` says field by field why."""

    def __init__(self, source: str, errors: list[FieldError]):
        self.source = source
        self.errors = errors
        super().__init__("\n".join(f"{source}: {e}" for e in errors))


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def field_errors(exc: ValidationError, prefix: str = "") -> list[FieldError]:
    """Flatten a pydantic ValidationError into field-located errors (camelCase paths)."""
    found: list[FieldError] = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        ctx = err.get("ctx") or {}
        if err["type"] == "cross_field":
            loc = loc + tuple(ctx["field"].split("."))
        path = _path(((prefix,) if prefix else ()) + loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif (
            "input" in err
            and err["type"] not in ("cross_field",)
            and not isinstance(err["input"], dict | list)
        ):
            msg = f"{msg} (got {err['input']!r})"
        found.append(FieldError(path, msg))
    return found


def parse_job(doc: Any, source: str = "<manifest>") -> TrainingJob:
    """Validate one manifest document; raises ManifestError naming every bad field."""
    if not isinstance(doc, dict):
        raise ManifestError(source, [FieldError("", "a TrainingJob manifest must be a mapping")])
    try:
        return TrainingJob.model_validate(doc)
    except ValidationError as exc:
        raise ManifestError(source, field_errors(exc)) from None


def parse_spec(spec: Any, source: str = "<spec>") -> TrainingJobSpec:
    """Validate a bare spec (as the operator receives it from the API server)."""
    try:
        return TrainingJobSpec.model_validate(spec)
    except ValidationError as exc:
        raise ManifestError(source, field_errors(exc, prefix="spec")) from None


MAX_MANIFEST_BYTES = 4 << 20  # far above any real manifest; refuses reading a disk image


def _read_text(path: Path, source: str) -> str:
    """The file as UTF-8 text, or a ManifestError with one line saying why not."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(source, [FieldError("", f"cannot read file: {exc.strerror}")]) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            source, [FieldError("", f"file larger than {MAX_MANIFEST_BYTES} bytes")]
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            source,
            [
                FieldError(
                    "", f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
                )
            ],
        ) from None
    if "\0" in text:
        raise ManifestError(source, [FieldError("", "binary file (contains NUL bytes)")])
    return text


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (1-based line and column)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = exc.problem or str(exc)
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return "invalid YAML: " + " ".join(str(exc).split())


def load_jobs(path: str | Path) -> list[TrainingJob]:
    """All TrainingJobs in a YAML file (multi-document files allowed)."""
    path = Path(path)
    source = str(path)
    text = _read_text(path, source)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(source, [FieldError("", _yaml_problem(exc))]) from None
    if not docs:
        raise ManifestError(source, [FieldError("", "no document in file")])
    jobs, errors = [], []
    for i, doc in enumerate(docs):
        where = source if len(docs) == 1 else f"{source}[{i}]"
        try:
            jobs.append(parse_job(doc, where))
        except ManifestError as exc:
            errors.extend(exc.errors)
    if errors:
        raise ManifestError(source, errors)
    return jobs


def load_job(path: str | Path) -> TrainingJob:
    """The single TrainingJob in a file."""
    jobs = load_jobs(path)
    if len(jobs) != 1:
        found = f"expected one TrainingJob, found {len(jobs)}"
        raise ManifestError(str(path), [FieldError("", found)])
    return jobs[0]
