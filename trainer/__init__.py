"""bulkhead.trainer: the PyTorch engine that survives the loss of workers in process.

config (one TrainConfig from the job spec) -> models/ (the model-family protocol, the
registry, the built-in families such as ``gpt``; the engine knows models only through the
protocol) and data/ (byte-level text or memory-mapped token shards, sample order a pure
function of seed and position; `bulkhead data prepare`) -> engine/
(one registered world per membership generation, the generation's parallel plan, the
layouts that train it: data parallel, ZeRO on FSDP2, Oobleck pipelines, Lazarus experts;
state moved between holders by one transfer plan) -> runtime/ (the elastic loop) ->
worker (the ``bulkhead-worker`` entry point; in a pod of G GPUs, pod/ is its launcher of
G trainer processes and their relay to the manager). checkpoint/ is the checkpoint engine and
its sidecar ``bulkhead-checkpointd``; planning/ holds the pure planners (pipeline
templates, expert placement), importable without torch; straggler scores compute-time
outliers.
"""
