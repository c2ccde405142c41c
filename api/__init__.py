"""TrainingJob API: pydantic models (the single source of the CRD), manifest loading, CRD.

This package imports nothing else of bulkhead, so every other part can depend on it.
"""

from bulkhead.api.manifest import (
    FieldError,
    ManifestError,
    load_job,
    load_jobs,
    parse_job,
    parse_spec,
)
from bulkhead.api.spec import API_GROUP, API_VERSION, KIND, TrainingJob, TrainingJobSpec
from bulkhead.api.status import Condition, Member, Membership, Recovery, TrainingJobStatus

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "KIND",
    "Condition",
    "FieldError",
    "ManifestError",
    "Member",
    "Membership",
    "Recovery",
    "TrainingJob",
    "TrainingJobSpec",
    "TrainingJobStatus",
    "load_job",
    "load_jobs",
    "parse_job",
    "parse_spec",
]
