"""The lifecycle model, pure (no I/O, no clock of its own, nothing of the drivers).

``types`` (events, decisions, the state), ``workers`` (slot and worker identity),
``policy`` (``decide``: one event in, a new state and decisions out), ``actions`` (what
the rules do to the state: membership changes, losses, restarts), ``hang`` (the hang rules
of a timer tick, as functions) and ``rebuild`` (the state of a job after a manager
restart, from its status).
"""
