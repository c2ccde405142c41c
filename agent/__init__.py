"""bulkhead.agent: the node agent (TEE), one per GPU node.

collectors/ (NVML, kernel-log XIDs, /proc, worker reports) -> detect/ (rules, robust change,
the multivariate detector, k-of-n persistence) -> health (the ``BulkheadAnomaly`` Node
condition) -> reporters/ (Node condition and Events, Prometheus). ``agent.Agent`` runs one
tick; ``service`` wires it from ``settings`` next to the FastAPI ``app``; ``main`` is the
``bulkhead-agent`` entry point and ``cli`` the ``bulkhead agent`` commands. Never imports torch.
"""
