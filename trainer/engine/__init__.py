"""The torch side of training one generation (the pure plans are in ``trainer.parallel``).

``parallelize`` (``build_engine``: the model the plan needs, laid out by one function per
parallelism), ``engine`` (one optimizer step committed on every rank; adoption of the
state from its holders), ``pipeline`` and ``experts`` (the step and state hooks of those
layouts), ``zero`` (FSDP2), ``data_parallel`` (DDP), ``grad_sync`` (the step agreement;
gradient sums over holders), ``groups`` (the key group of a parameter, from the model
protocol), ``state`` (held state, assembly, transfer execution), ``pretrained`` (a fresh
start from pretrained weights), ``world`` / ``device`` / ``failfast`` (the generation's
communicators and their failure handling), ``optim`` (optimizer and schedule).
"""
