"""bulkhead.operator: the lifecycle manager (TOL). Never imports torch.

lifecycle* is the pure policy: events in, decisions out, time passed in. session applies it
to one job: it serves the control protocol (control, FastAPI), runs the hang timer and hands
decisions to a driver (driver.Driver). Two drivers share everything else: local/ (workers
are processes: ``bulkhead run``) and k8s/ (workers are pods; Kopf handlers, ``main`` is the
``bulkhead-operator`` entry point). metrics holds the manager's Prometheus metrics.
"""
