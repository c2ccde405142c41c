"""bulkhead.operator: the lifecycle manager (TOL). Never imports torch.

``lifecycle/`` is the pure policy: events in, decisions out, time passed in. ``session/``
applies it to one job: it serves the control protocol (``control``, FastAPI, one
``ControlServer`` for both modes), takes every driver observation through one inbox
(``JobSession.observe``), runs the hang timer and hands decisions to a driver
(``driver.Driver``). Two drivers share everything else: ``local/`` (workers are processes:
``bulkhead run``) and ``k8s/`` (workers are pods; Kopf handlers, ``k8s/main.py`` is the
``bulkhead-operator`` entry point). ``metrics`` holds the manager's Prometheus metrics.
"""
