"""A test-only kubelet stand-in: runs the pods bound to marked nodes as local processes.

Not a product. The test cluster (hack/k8s_cluster.py) has no container runtime: KWOK marks
the pods of its nodes Running without running anything. The pod runner manages other
nodes, the ones labelled `bulkhead.dev/pod-runner=true` (and never annotated for KWOK), and
really runs their pods on this machine:

- each container's command/args from the project's virtualenv (the image is ignored),
  with `env` (values, `$(VAR)` references, `valueFrom` secretKeyRef/configMapKeyRef/fieldRef)
  resolved, GPU requests given as `NVIDIA_VISIBLE_DEVICES`/`BULKHEAD_GPU_COUNT`;
- in a private mount namespace where the volumes (emptyDir, secret, configMap, projected
  service-account token, hostPath under a per-node root, PVC as a host dir per claim) are
  bind-mounted at their mountPaths and the root filesystem is read-only when asked;
- in a network namespace of the pod with its own IP on a bridge (`bh-pods`), so pods reach
  each other, the host reaches them, and they reach the API server (10.96.0.1:443), the
  ClusterIP Services and hostPorts of their node through small TCP forwarders; an
  /etc/hosts per pod names the Services and the headless Services' pods;
- readiness and liveness probes (httpGet, tcpSocket), restarts per restartPolicy, native
  sidecars (init containers with restartPolicy Always);
- pod status written back (phase, podIP, hostIP, conditions, container states, exit codes,
  restart counts); processes killed when the pod is deleted or its node is lost.

Module map: `model` (pure: env, volumes, status), `network` (bridge, namespaces, forwarders),
`launch` (runs inside the pod's namespaces, then execs the command), `runner` (the loop).
Needs root (namespaces, mounts) and `ip`/`unshare` from iproute2/util-linux. One runner per
machine (the bridge and 10.96.0.1 are the machine's): a second one waits on a lock file.
"""

from podrunner.runner import NODE_LABEL, PodRunner

__all__ = ["NODE_LABEL", "PodRunner"]
