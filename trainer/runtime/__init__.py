"""The elastic worker runtime: one worker's life across membership generations.

- ``control_client``: the client side of the control protocol (the ``ControlChannel``
  interface, the membership watcher and progress reporter threads).
- ``probe``: after a failed collective, which peers this worker cannot reach.
- ``timeline``: where a worker's time goes between generations.
- ``samples_log``: the consumed-samples log rank 0 keeps in local mode.
- ``checkpointing``: the adapter to the checkpoint engine (snapshots, restore, peer ring).
- ``node_agent``: reports to this node's agent (step, loss, step time, stragglers).
- ``loop``: ``ElasticTrainer``, which ties them together and survives membership changes
  (and feeds the compute times each step shares to ``bulkhead.trainer.straggler``).
"""
