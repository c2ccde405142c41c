"""The pure parallel layer (no torch): what every rank computes alike from the membership
and the spec, with no byte exchanged.

``plan`` (the immutable ``ParallelPlan`` of a generation), ``pipeline_plan`` (Oobleck
pipelines: stages, batch shares, schedules), ``experts_plan`` (Lazarus expert placement),
``dispatch`` (which routed token goes to which replica), ``layout`` (state keys and who
holds which element ranges), ``transfer`` (the moves between holders). The torch code
that carries them out is in ``trainer/engine``.
"""
