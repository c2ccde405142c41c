"""The torch side of training one generation (the pure plans are in ``trainer.parallel``).

``parallelize`` (``build_engine``: the model the plan needs, laid out by one function per
parallelism, and the engine's parts), ``engine`` (one ``Engine``: one optimizer step
committed on every rank, its state as keys), ``adoption`` (a new engine takes the state
from its holders: roll forward, exchange, transfer or fresh start), ``parts`` (what
differs per parallelism), ``holdings`` (who holds which keys: whole-world or grouped),
``local_step`` (the whole model's passes; DP/ZeRO keys), ``pipeline`` (a stage's 1F1B/GPipe
schedule and keys) and ``experts`` (quota dispatch, expert keys, placement and
rebalancing), ``zero`` (FSDP2), ``data_parallel`` (DDP), ``grad_sync`` (the step
agreement; gradient sums over holders), ``clip`` (global-norm clipping), ``groups`` (the
key group of a parameter, from the model protocol), ``state`` (held state, assembly),
``transfers`` (carrying out a transfer plan), ``pretrained`` (a fresh start from
pretrained weights), ``world`` / ``device`` / ``failfast`` (the generation's
communicators and their failure handling), ``optim`` (optimizer, its materialised state,
schedule).
"""
