"""Node agent benchmark: CPU and memory overhead at a 1 s interval, detection latency per fault.

Overhead: the real ``bulkhead-agent`` process (host collector, kernel-log follower, report
API, rule and multivariate detectors, Prometheus metrics) runs for ``--seconds`` while a
fake trainer posts a report every second; its CPU time and RSS are read with psutil after
a warm-up. The baseline is the same process configured never to tick (the bare HTTP
service), so the ratio isolates the cost of monitoring; the issue's budget (1 % of a core,
100 MB RSS) is printed beside it. No GPUs here: NVML reads are not included.

Latency: each replayed fault trace (``bulkhead.agent.replay``) runs through the production
agent at a simulated 1 s interval with the test settings (hang timeout 10 s); the latency
is the time from the fault's first tick to the Node condition.

Run: ``python bench/agent.py [--quick] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bulkhead.agent.replay import ReplayGpuSource, ReplayLineSource, SimClock, replay, scenarios
from bulkhead.agent.service import Sources, build
from bulkhead.agent.settings import AgentSettings
from bulkhead.api.protocol import job_report_token

BUDGET_CORE_FRACTION = 0.01
BUDGET_RSS_MB = 100.0
TOKEN = "bench-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_process(interval_s: float, seconds: float, warmup_s: float) -> dict[str, float]:
    """Run bulkhead-agent; CPU fraction of one core and RSS (MB) over ``seconds``."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        kernel_log = Path(tmp) / "kern.log"
        kernel_log.write_text("")
        env = {
            **os.environ,
            "BULKHEAD_AGENT_NODE_NAME": "bench-node",
            "BULKHEAD_AGENT_INTERVAL_S": str(interval_s),
            "BULKHEAD_AGENT_LISTEN_HOST": "127.0.0.1",
            "BULKHEAD_AGENT_PORT": str(port),
            "BULKHEAD_AGENT_REPORT_TOKEN": TOKEN,
            "BULKHEAD_AGENT_KUBERNETES": "false",
            "BULKHEAD_AGENT_GPU": "none",
            "BULKHEAD_AGENT_KERNEL_LOG": str(kernel_log),
            "BULKHEAD_AGENT_MULTIVARIATE_WARMUP": "10",
        }
        env.pop("BULKHEAD_AGENT_CONFIG", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bulkhead.agent.main", "--log-level", "WARNING"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            ps = psutil.Process(proc.pid)
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(
                        f"agent did not start: {proc.stderr.read().decode()[-2000:]}"
                    )  # type: ignore[union-attr]
                time.sleep(0.2)
            step = 0

            def feed(until: float) -> None:
                nonlocal step
                while time.monotonic() < until:
                    step += 1
                    http.post(
                        "/v1/jobs/bench/report",
                        json={"worker": "bench-w0", "step": step, "loss": 2.0, "stepTimeS": 1.0},
                        headers={"Authorization": f"Bearer {job_report_token(TOKEN, 'bench')}"},
                    )
                    with kernel_log.open("a") as log:  # some kernel chatter to follow
                        log.write(f"[{step}.0] eth0: link status check ok\n")
                    time.sleep(1.0)

            feed(time.monotonic() + warmup_s)
            cpu0 = sum(ps.cpu_times()[:2])
            t0 = time.monotonic()
            feed(t0 + seconds)
            cpu = sum(ps.cpu_times()[:2]) - cpu0
            elapsed = time.monotonic() - t0
            rss_mb = ps.memory_info().rss / 2**20
            http.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"core_fraction": cpu / elapsed, "rss_mb": rss_mb}


def detection_latency() -> dict[str, Any]:
    logging.disable(logging.CRITICAL)  # the replayed faults log loudly; the table says it all
    out: dict[str, Any] = {}
    for scenario in scenarios():
        gpu, lines, clock = ReplayGpuSource(), ReplayLineSource(), SimClock()
        settings = AgentSettings(
            node_name="bench", hang_timeout_s=10, healthy_period_s=10, kubernetes=False
        )
        built = build(settings, Sources(gpu=gpu, kernel_log=lines, api=None, host=False), clock)
        outcome = replay(scenario, built.agent, gpu, lines, clock)
        out[scenario.name] = {
            "expected": str(scenario.expected) if scenario.expected else None,
            "detected": outcome.reason,
            "latency_s": outcome.latency_ticks(scenario),
            "cleared_after_fault_s": (
                None if outcome.cleared_at is None else outcome.cleared_at - scenario.fault_end
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (smoke test)")
    parser.add_argument("--seconds", type=float, help="measurement window per process")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    seconds = args.seconds or (6.0 if args.quick else 120.0)
    warmup = 2.0 if args.quick else 15.0

    ours = measure_process(1.0, seconds, warmup)
    bare = measure_process(3600.0, seconds, warmup)
    latency = detection_latency()

    print(f"agent overhead over {seconds:.0f} s (1 s interval, reports every 1 s, no GPUs)")
    print(f"{'':<22}{'ours':>10}{'no ticks':>10}{'ratio':>8}{'budget':>9}{'of budget':>11}")
    rows = [("CPU (fraction of core)", "core_fraction", BUDGET_CORE_FRACTION),
            ("RSS (MB)", "rss_mb", BUDGET_RSS_MB)]  # fmt: skip
    for label, key, budget in rows:
        ratio = ours[key] / bare[key] if bare[key] else float("inf")
        print(
            f"{label:<22}{ours[key]:>10.4f}{bare[key]:>10.4f}{ratio:>8.2f}"
            f"{budget:>9.2f}{ours[key] / budget:>11.2f}"
        )
    print("\ndetection latency (simulated 1 s ticks; hang timeout 10 s)")
    for name, row in latency.items():
        print(
            f"  {name:<26} expected {row['expected']!s:<18} got {row['detected']!s:<18} "
            f"latency {row['latency_s']!s:>4} s"
        )
    faults = [r["latency_s"] for r in latency.values() if r["expected"] is not None]
    figures = {
        "cpu_core_fraction": ours["core_fraction"],
        "rss_mb": ours["rss_mb"],
        "baseline_cpu_core_fraction": bare["core_fraction"],
        "baseline_rss_mb": bare["rss_mb"],
        "cpu_vs_baseline": ours["core_fraction"] / bare["core_fraction"]
        if bare["core_fraction"]
        else None,
        "rss_vs_baseline": ours["rss_mb"] / bare["rss_mb"],
        "cpu_of_budget": ours["core_fraction"] / BUDGET_CORE_FRACTION,
        "rss_of_budget": ours["rss_mb"] / BUDGET_RSS_MB,
        "detection_latency_max_s": max(f for f in faults if f is not None)
        if all(f is not None for f in faults)
        else None,
        "false_conditions_on_clean_traces": sum(
            1 for r in latency.values() if r["expected"] is None and r["detected"] is not None
        ),
        "latency": latency,
        "seconds": seconds,
    }
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
