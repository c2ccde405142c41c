"""``bulkhead-operator``: Kopf, the lifecycle sessions and the control endpoint in one process.

The Kubernetes entry point; local mode's is ``bulkhead.operator.local.runner``. Both serve
the workers with the same ``ControlServer``.

One asyncio loop runs the Kopf operator (TrainingJobs), our pod and node watches and the
control endpoint (uvicorn serving the FastAPI app the workers talk to, which also serves
``/metrics`` and ``/healthz``). SIGTERM stops both; sessions stop without touching pods, so
the next operator instance adopts the running workers. With ``--leader-elect`` several
replicas run and only the holder of the Lease does any of this (see ``leader``); a leader
that loses the Lease exits at once with code 1 so its pod restarts as a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from datetime import UTC, datetime
from typing import Any

import click
import httpx
import kopf

from bulkhead.operator.control import ControlServer, create_control_app, run_event_loop
from bulkhead.operator.k8s.handlers import build_registry, kopf_settings
from bulkhead.operator.k8s.kube import KubeClient, KubeError, load_credentials
from bulkhead.operator.k8s.leader import ElectionSettings, LeaderElector, route_to
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


EXIT_LEADERSHIP_LOST = 1  # the process's exit code when it loses the Lease


def elector_for(settings: OperatorSettings, client: KubeClient) -> LeaderElector:
    identity = (
        settings.leader_election_identity
        or settings.pod_name
        or f"{socket.gethostname()}-{os.getpid()}"
    )
    return LeaderElector(
        client,
        ElectionSettings(
            namespace=settings.leader_election_namespace or settings.operator_namespace,
            name=settings.leader_election_lease,
            identity=identity,
            lease_duration_s=settings.lease_duration_s,
            renew_deadline_s=settings.renew_deadline_s,
            retry_period_s=settings.retry_period_s,
        ),
    )


async def serve_liveness(host: str, port: int) -> asyncio.Server:
    """``GET /livez`` -> 200 while the event loop runs: the liveness probe of leader and
    standbys alike (a standby has no control endpoint to probe)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, host=host, port=port)


async def serve(settings: OperatorSettings, stop: asyncio.Event | None = None) -> None:
    """Run the operator until ``stop`` is set (or SIGTERM/SIGINT in the main thread).

    Elected, it exits the process (code ``EXIT_LEADERSHIP_LOST``) the moment it loses the
    Lease.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    credentials = load_credentials(settings.kubeconfig)
    client = KubeClient(credentials, concurrency=settings.kube_concurrency)
    liveness = (
        await serve_liveness(settings.listen_host, settings.health_port)
        if settings.health_port
        else None
    )
    elector = elector_for(settings, client) if settings.leader_elect else None
    # Built before the election (a standby is ready to serve the moment it leads): the
    # app's construction takes seconds on a loaded node, and an elected leader must be
    # free to renew its Lease from the first moment.
    registry = SessionRegistry()
    app = create_control_app(registry)
    try:
        if elector is not None and not await elector.acquire(stop):
            return  # stopped while a standby
        await _lead(settings, client, credentials, elector, stop, registry, app)
    finally:
        if liveness is not None:
            liveness.close()
        await client.close()


async def _lead(
    settings: OperatorSettings,
    client: KubeClient,
    credentials: Any,
    elector: LeaderElector | None,
    stop: asyncio.Event,
    registry: SessionRegistry,
    app: Any,
) -> None:
    """Everything the (elected) operator does, until ``stop`` or lost leadership."""

    async def keep_lease() -> None:
        assert elector is not None
        await elector.keep(stop)
        if not stop.is_set():
            # Deposed: lost to another replica, or not renewed within the renew deadline,
            # so another replica may lead now. Every write is fenced off already; exiting
            # at once also stops serving the workers and ends every retry, where a graceful
            # stop (sessions, pending pod creates) could outlast the lease. The workers are
            # untouched; the pod restarts as a standby and the leader adopts the jobs.
            log.error("leadership lost: exiting now so the pod restarts as a standby")
            logging.shutdown()
            os._exit(EXIT_LEADERSHIP_LOST)

    keeper = None
    if elector is not None:
        client.fence = elector.is_leading  # no write leaves once the lease may be lost
        keeper = asyncio.create_task(keep_lease(), name="lease")
    # The same control endpoint as local mode; binding raises at once if the port is taken.
    server = ControlServer(app, host=settings.listen_host, port=settings.listen_port)
    await server.start()
    if elector is not None and settings.pod_name:
        await route_to(client, settings.operator_namespace, settings.pod_name)
    port = server.port
    control_url = settings.worker_control_url(port)
    log.info("control endpoint on %s:%d; workers use %s", settings.listen_host, port, control_url)

    runtime = OperatorRuntime(client, settings, registry, control_url)
    untaint = asyncio.create_task(runtime.untaint_loop(), name="untaint")
    feeds = [asyncio.create_task(feed.run(), name=feed.name) for feed in runtime.feeds()]
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
        for feed in feeds:
            feed.cancel()
        await runtime.shutdown()
        await server.stop()
        if keeper is not None:
            keeper.cancel()
        if elector is not None:
            if settings.pod_name:
                with contextlib.suppress(KubeError, httpx.HTTPError, OSError):
                    await route_to(client, settings.operator_namespace, None)
            await elector.release()


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
@click.option(
    "--leader-elect/--no-leader-elect",
    default=None,
    help="Elect one active replica through a Lease (the others wait as standbys).",
)
@click.option("--leader-election-namespace", default=None, help="Namespace of the Lease.")
@click.option(
    "--leader-election-identity", default=None, help="This replica's name (default: the pod's)."
)
@click.option("--lease-duration", "lease_duration_s", type=float, default=None)
@click.option("--renew-deadline", "renew_deadline_s", type=float, default=None)
@click.option("--retry-period", "retry_period_s", type=float, default=None)
@click.option("--health-port", type=int, default=None, help="Port of /livez (liveness).")
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None)
@click.option("--log-level", default=None)
def main(namespaces: tuple[str, ...], **options: Any) -> None:
    """Run the bulkhead lifecycle operator."""
    overrides = {k: v for k, v in options.items() if v is not None}
    if namespaces:
        overrides["namespaces"] = list(namespaces)
    settings = OperatorSettings(**overrides)
    configure_logging(settings)
    log.info("starting: %s", settings.model_dump(exclude={"kubeconfig", "agent_report_token"}))
    run_event_loop(serve(settings))


if __name__ == "__main__":
    main()
