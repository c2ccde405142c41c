"""``bulkhead-operator``: Kopf, the lifecycle sessions and the control endpoint in one process.

The Kubernetes entry point; local mode's is ``bulkhead.operator.local.runner``. Both serve
the workers with the same ``ControlServer``.

One asyncio loop runs the Kopf operator (TrainingJob, pod and node watches) and the
control endpoint (uvicorn serving the FastAPI app the workers talk to, which also serves
``/metrics`` and ``/healthz``). SIGTERM stops both; sessions stop without touching pods, so the next
operator instance adopts the running workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from datetime import UTC, datetime
from typing import Any

import click
import kopf

from bulkhead.operator.control import ControlServer, create_control_app
from bulkhead.operator.k8s.handlers import build_registry, kopf_settings
from bulkhead.operator.k8s.kube import KubeClient, load_credentials
from bulkhead.operator.k8s.runtime import OperatorRuntime
from bulkhead.operator.k8s.settings import OperatorSettings
from bulkhead.operator.session.job import SessionRegistry

log = logging.getLogger("bulkhead.operator")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (+ exception, + Kopf object)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        k8s_object = getattr(record, "k8s_ref", None)  # set by Kopf's per-object loggers
        if isinstance(k8s_object, dict):
            out["object"] = {k: k8s_object.get(k) for k in ("kind", "namespace", "name")}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(settings: OperatorSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    # Per-request access logs of the long polls, and Kopf's "handler succeeded" line for
    # every pod and node event, would drown everything else.
    quiet = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    for name in ("uvicorn.access", "kopf.objects", "httpx"):
        logging.getLogger(name).setLevel(quiet)


async def serve(settings: OperatorSettings, stop: asyncio.Event | None = None) -> None:
    """Run the operator until ``stop`` is set (or SIGTERM/SIGINT in the main thread)."""
    stop = stop or asyncio.Event()
    credentials = load_credentials(settings.kubeconfig)
    client = KubeClient(credentials, concurrency=settings.kube_concurrency)
    registry = SessionRegistry()
    # The same control endpoint as local mode; binding raises at once if the port is taken.
    server = ControlServer(
        create_control_app(registry), host=settings.listen_host, port=settings.listen_port
    )
    await server.start()
    port = server.port
    control_url = settings.worker_control_url(port)
    log.info("control endpoint on %s:%d; workers use %s", settings.listen_host, port, control_url)

    runtime = OperatorRuntime(client, settings, registry, control_url)
    untaint = asyncio.create_task(runtime.untaint_loop(), name="untaint")
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await kopf.operator(
            registry=build_registry(runtime, credentials),
            settings=kopf_settings(),
            standalone=True,
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            stop_flag=stop,
        )
    finally:
        log.info("operator stopping")
        untaint.cancel()
        await runtime.shutdown()
        await server.stop()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-n",
    "--namespace",
    "namespaces",
    multiple=True,
    help="Watch this namespace "
    "(repeatable; default: all namespaces, or BULKHEAD_OPERATOR_NAMESPACES).",
)
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--listen-host", default=None, help="Address of the control endpoint.")
@click.option("--port", "listen_port", type=int, default=None, help="Control endpoint port.")
@click.option("--control-url", default=None, help="URL workers reach the endpoint at.")
@click.option("--image", default=None, help="Image of the checkpoint sidecar.")
@click.option(
    "--untaint-after-healthy-seconds",
    "untaint_after_healthy_s",
    type=float,
    default=None,
    help="Remove our taint after a node is healthy this long (default 600; 0 = never).",
)
@click.option(
    "--status-interval",
    "status_min_interval_s",
    type=float,
    default=None,
    help="Minimum seconds between progress-only status writes.",
)
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None)
@click.option("--log-level", default=None)
def main(namespaces: tuple[str, ...], **options: Any) -> None:
    """Run the bulkhead lifecycle operator."""
    overrides = {k: v for k, v in options.items() if v is not None}
    if namespaces:
        overrides["namespaces"] = list(namespaces)
    settings = OperatorSettings(**overrides)
    configure_logging(settings)
    log.info("starting: %s", settings.model_dump(exclude={"kubeconfig"}))
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
