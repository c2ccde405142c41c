"""The ``bulkhead`` command line: ``main`` (the entry point and the commands that need only
``api``) and ``plan`` (``bulkhead plan``, which draws on the planners, the parallel plan
and the engine). A sub-command that drives one component lives with it.
"""
