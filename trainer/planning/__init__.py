"""Planners: which ranks run which layers and experts, and what moves when nodes are lost.

Pure Python + numpy (no torch), so the operator and the CLI can plan too:

- ``costs``: per-layer time and memory (analytic estimate; ``profile`` measures torch modules).
- ``templates`` (+ ``template_search``): exact 1F1B pipeline templates for every node count.
- ``instantiate``: templates -> pipelines -> ranks, and the integer batch split.
- ``reconfigure``: the plan after losing nodes and which rank sends which layer shard.
- ``experts``: Lazarus replica allocation and MRO placement; ``recovery``: exact recovery
  probability; ``expert_migration``: re-placement after failures; ``dispatch_quotas``:
  integer, local-first token quotas.

``bulkhead plan`` (``bulkhead.cli.plan``) shows what they decide for a job.
"""
