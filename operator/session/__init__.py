"""A job session: the lifecycle policy meeting time and I/O for one job.

``job`` (``JobSession``: the control protocol handlers, the one inbox for driver
observations, the hang timer), ``effects`` (carries decisions out through the driver) and
``status`` (the status the session publishes, conditions included).
"""
