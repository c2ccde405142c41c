"""The Kubernetes driver of the lifecycle manager: workers are pods, bad nodes are tainted.

Pure parts (object builders, pod/node classification, untaint and status-write policies)
are separate from the parts that talk to the API server (``kube``, ``driver``, ``runtime``,
``handlers``), so the decisions are tested without a cluster.
"""
