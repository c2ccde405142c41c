"""Suite-wide test set-up: small thread pools (2 cores) and the shared fixtures."""

import os

# Many processes share 2 cores in the multi-process tests; one thread each avoids thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from exit_cleanup import release_frozen_objects
from k8s_fixtures import (  # noqa: F401  (registers the fixtures and the k8s marking)
    k8s_cluster,
    k8s_namespace,
    pytest_collection_modifyitems,
)


def pytest_unconfigure() -> None:
    release_frozen_objects()  # see tests/exit_cleanup.py
