"""Wiring: build the agent from settings and run its loop next to the HTTP server.

Sources and the Kubernetes client are parameters, so tests build the production agent
around replayed traces and a test control plane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from bulkhead.agent.agent import Agent, Collectors, Reporter
from bulkhead.agent.app import create_app
from bulkhead.agent.collectors import gpu as gpu_mod
from bulkhead.agent.collectors import kernel_log
from bulkhead.agent.collectors.gpu import GpuCollector, GpuSource
from bulkhead.agent.collectors.host import HostCollector
from bulkhead.agent.collectors.kernel_log import LineSource, XidCollector
from bulkhead.agent.collectors.training import TrainingCollector
from bulkhead.agent.detect.metric import MetricAnomalyDetector
from bulkhead.agent.detect.persistence import Persistence
from bulkhead.agent.detect.rules import RuleDetector, RuleThresholds
from bulkhead.agent.health import NodeHealth
from bulkhead.agent.reporters.metrics import AgentMetrics
from bulkhead.agent.settings import AgentSettings
from bulkhead.agent.tokens import AgentTokens, token_file_reader

log = logging.getLogger(__name__)


@dataclass
class Sources:
    """Where the agent reads and writes; ``None`` turns that part off."""

    gpu: GpuSource | None
    kernel_log: LineSource | None
    api: object | None  # a kubernetes.client.ApiClient
    host: bool = True

    @classmethod
    def from_settings(cls, settings: AgentSettings) -> Sources:
        api = None
        if settings.kubernetes:
            from bulkhead.agent.reporters import kube  # the client is only needed here

            api = kube.api_client(settings.kubeconfig)
        return cls(
            gpu=gpu_mod.open_source(settings.gpu),
            kernel_log=kernel_log.open_source(settings.kernel_log),
            api=api,
        )


@dataclass
class Built:
    agent: Agent
    metrics: AgentMetrics
    app: FastAPI


def build(
    settings: AgentSettings,
    sources: Sources | None = None,
    clock: Callable[[], float] = time.time,
) -> Built:
    """The agent for ``settings`` around ``sources`` (default: the real ones)."""
    sources = sources or Sources.from_settings(settings)
    collectors = Collectors(TrainingCollector(settings.forget_worker_after_s))
    if sources.gpu is not None:
        collectors.others.append(GpuCollector(sources.gpu))
    if sources.kernel_log is not None:
        collectors.others.append(XidCollector(sources.kernel_log))
    if sources.host:
        collectors.others.append(HostCollector(settings.proc_root))
    metrics = AgentMetrics()
    reporters: list[Reporter] = [metrics]
    if sources.api is not None:
        from bulkhead.agent.reporters import kube

        client = sources.api
        kube.check_own_node(client, settings.node_name, settings.api_timeout_s)
        reporters += [
            kube.NodeConditionReporter(
                client, settings.node_name, settings.heartbeat_s, settings.api_timeout_s
            ),
            kube.NodeEventReporter(
                client,
                settings.node_name,
                settings.event_namespace,
                settings.events_per_minute,
                settings.api_timeout_s,
            ),
        ]
    thresholds = RuleThresholds(
        hang_timeout_s=settings.hang_timeout_s,
        pcie_replays_per_tick=settings.pcie_replays_per_tick,
        memory_available_min_frac=settings.memory_available_min_frac,
        step_time_z=settings.step_time_z,
    )
    agent = Agent(
        collectors=collectors,
        rules=RuleDetector(thresholds),
        persistence=Persistence(settings.windows()),
        health=NodeHealth(settings.healthy_period_s, settings.condition_severities, clock()),
        reporters=reporters,
        metric=MetricAnomalyDetector(settings.multivariate_warmup)
        if settings.multivariate
        else None,
        severities=settings.severities,
        clock=clock,
    )
    tokens = AgentTokens(_token_source(settings))
    if tokens.current is None:
        log.warning("no token configured: worker reports are refused")
    app = create_app(
        agent,
        metrics,
        settings.node_name,
        tokens,
        stale_after_s=max(30.0, 10 * settings.interval_s),
    )
    return Built(agent, metrics, app)


def _token_source(settings: AgentSettings) -> Callable[[], str | None]:
    """Where the agents' token is read: its file (re-read on rotation) or the setting."""
    if settings.report_token_file is not None:
        return token_file_reader(settings.report_token_file)
    token = settings.report_token.get_secret_value() if settings.report_token else None
    return lambda: token


def serve(settings: AgentSettings) -> None:
    """Run the detection loop in a thread and the HTTP server in the foreground until SIGTERM."""
    built = build(settings)
    stop = threading.Event()
    loop = threading.Thread(
        target=built.agent.run, args=(stop, settings.interval_s), name="agent-loop", daemon=True
    )
    loop.start()
    log.info(
        "bulkhead-agent on node %s listening on %s:%d",
        settings.node_name,
        settings.listen_host,
        settings.port,
    )
    try:
        uvicorn.run(
            built.app,
            host=settings.listen_host,
            port=settings.port,
            log_level="warning",
            access_log=False,
        )
    finally:
        stop.set()
        loop.join(timeout=max(5.0, 2 * settings.interval_s))
