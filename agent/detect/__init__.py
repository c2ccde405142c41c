"""Detectors of the node agent: pure, streaming, fed by collectors, feeding reporters.

``MultivariateDetector`` is the stable evaluation interface other code relies on:
``fit(train[T, D]) -> self``, ``run(test[T, D]) -> Run`` (scores, 0/1 flags and per-metric
shares) and ``predict(test[T, D]) -> 0/1 flags[T]``; ``observe(x[D])`` streams.
"""

from bulkhead.agent.detect.multivariate import DetectorParams, MultivariateDetector

__all__ = ["DetectorParams", "MultivariateDetector"]
