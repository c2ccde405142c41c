"""Suite-wide test set-up: small thread pools (2 cores) and the shared fixtures."""

import os

import pytest

# Many processes share 2 cores in the multi-process tests; one thread each avoids thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from exit_cleanup import release_frozen_objects
from k8s_fixtures import (  # noqa: F401  (registers the fixtures and the k8s marking)
    k8s_cluster,
    k8s_namespace,
    pytest_collection_modifyitems,
)

from bulkhead.trainer.pod.prestart import become_subreaper


@pytest.fixture(autouse=True)
def _orphans_back_to_init():
    """A local driver or a pod launcher run in this process makes it a subreaper (its
    template's forks become its children): after each test, processes orphaned by later
    tests go to init again, not to zombies nobody here reaps (which a test waiting for a
    killed process's end would see alive)."""
    yield
    become_subreaper(False)


def pytest_unconfigure() -> None:
    release_frozen_objects()  # see tests/exit_cleanup.py
