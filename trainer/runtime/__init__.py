"""The elastic worker runtime: per-generation process groups, state sync, the training loop.

- ``sampler``: which stream positions each rank trains on at a step (pure).
- ``group``: the TCPStore this worker hosts and the torch.distributed group of a generation.
- ``state``: the training state and its broadcast from the newest surviving replica.
- ``step``: one data-parallel optimizer step (gradients weighted by samples).
- ``control``: the control-endpoint interface and the membership watcher thread.
- ``samples_log``: the consumed-samples log rank 0 keeps in local mode.
- ``checkpointing``: the adapter to the checkpoint engine (snapshots, restore, peer ring).
- ``node_agent``: reports to this node's agent (step, loss, step time, stragglers).
- ``loop``: ``ElasticTrainer``, which ties them together and survives membership changes
  (and feeds the compute times each step shares to ``bulkhead.trainer.straggler``).
"""
