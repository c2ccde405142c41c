"""Detectors of the node agent: pure, streaming, fed by collectors, feeding reporters.

``MultivariateDetector`` is the stable evaluation interface other code relies on:
``fit(train[T, D]) -> self`` and ``predict(test[T, D]) -> 0/1 flags[T]``.
"""

from bulkhead.agent.detect.multivariate import DetectorParams, MultivariateDetector

__all__ = ["DetectorParams", "MultivariateDetector"]
