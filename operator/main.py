"""The ``bulkhead-operator`` console script named in pyproject.toml.

The operator lives in ``bulkhead.operator.k8s.main``; this name stays only as long as
pyproject.toml's ``[project.scripts]`` points here.
"""

from bulkhead.operator.k8s.main import main

__all__ = ["main"]
