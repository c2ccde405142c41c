"""Agent configuration: a YAML file plus ``BULKHEAD_AGENT_*`` environment variables.

Precedence (highest first): constructor arguments, environment (nested fields with ``__``,
e.g. ``BULKHEAD_AGENT_PERSISTENCE__THERMALTHROTTLE__K=5``), the YAML file named by
``BULKHEAD_AGENT_CONFIG`` (or ``--config``), then the defaults below. Unknown keys are
rejected so a typo never silently leaves a default in place.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from bulkhead.agent.detect.persistence import Window
from bulkhead.api.node_problems import Reason
from bulkhead.api.spec import Severity

CONFIG_ENV = "BULKHEAD_AGENT_CONFIG"


class WindowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int = Field(1, ge=1)
    n: int = Field(1, ge=1)

    def window(self) -> Window:
        return Window(self.k, self.n)


# Hard faults escalate at once (k = n = 1, the default); symptoms that can be momentary
# must persist.
DEFAULT_PERSISTENCE: dict[Reason, Window] = {
    Reason.THERMAL_THROTTLE: Window(k=3, n=5),
    Reason.POWER_THROTTLE: Window(k=3, n=5),
    Reason.INTERCONNECT_ERRORS: Window(k=2, n=5),
    Reason.HOST_PRESSURE: Window(k=3, n=5),
    Reason.METRIC_ANOMALY: Window(k=10, n=20),
    Reason.STRAGGLER: Window(k=2, n=3),
}


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BULKHEAD_AGENT_",
        env_nested_delimiter="__",
        extra="forbid",
        case_sensitive=False,
    )

    node_name: str = Field(
        default_factory=lambda: os.environ.get("NODE_NAME") or socket.gethostname(),
        min_length=1,
        description="This node (the DaemonSet sets NODE_NAME from spec.nodeName).",
    )
    interval_s: float = Field(1.0, gt=0, le=3600, description="Seconds between ticks.")
    listen_host: str = "0.0.0.0"
    port: int = Field(9402, ge=0, le=65535)
    report_token: SecretStr | None = Field(
        None,
        description="The agents' token: /v1/anomalies takes it, and each job's report token "
        "derives from it (api.protocol.job_report_token); reports are refused without one.",
    )
    report_token_file: Path | None = Field(
        None,
        description="A file holding the agents' token instead (a mounted Secret key): "
        "re-read when a request shows a token it does not know, so a rotated token is "
        "taken without a restart and the one it replaced stays admitted (agent/tokens.py).",
    )
    gpu: Literal["auto", "nvml", "none"] = "auto"
    kernel_log: str = Field("/dev/kmsg", description="Kernel log: /dev/kmsg, a file, or ''.")
    proc_root: Path = Path("/proc")
    kubernetes: bool = Field(True, description="Publish the Node condition and Events.")
    kubeconfig: Path | None = Field(None, description="Off-cluster credentials; else in-cluster.")
    event_namespace: str = "default"
    api_timeout_s: float = Field(10.0, gt=0)
    heartbeat_s: float = Field(
        60.0, gt=0, description="Re-write the condition at least this often."
    )
    events_per_minute: int = Field(30, ge=1)
    healthy_period_s: float = Field(
        120.0, ge=0, description="Problem-free time before the condition returns to False."
    )
    condition_severities: list[Severity] = Field(
        default_factory=lambda: ["warning", "critical"],
        description="Severities that set the Node condition (others only raise Events).",
    )
    severities: dict[Reason, Severity] = Field(
        default_factory=dict, description="Per-reason severity overrides."
    )
    persistence: dict[Reason, WindowConfig] = Field(
        default_factory=dict, description="Per-reason k-of-n overrides of DEFAULT_PERSISTENCE."
    )
    hang_timeout_s: float = Field(120.0, gt=0)
    pcie_replays_per_tick: int = Field(100, ge=0)
    memory_available_min_frac: float = Field(0.03, ge=0, le=1)
    step_time_z: float = Field(8.0, gt=0)
    forget_worker_after_s: float = Field(3600.0, gt=0)
    multivariate: bool = True
    multivariate_warmup: int = Field(600, ge=10, description="Healthy ticks to fit on.")

    @field_validator("persistence")
    @classmethod
    def _windows_valid(cls, value: dict[Reason, WindowConfig]) -> dict[Reason, WindowConfig]:
        for reason, window in value.items():
            if window.k > window.n:
                raise ValueError(f"{reason}: k ({window.k}) must be <= n ({window.n})")
        return value

    def windows(self) -> dict[str, Window]:
        """The persistence window of every reason: defaults, then the configured overrides."""
        merged = {**DEFAULT_PERSISTENCE, **{r: w.window() for r, w in self.persistence.items()}}
        return {str(reason): window for reason, window in merged.items()}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file (if any) is set by ``load_settings`` through model_config["yaml_file"].
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))


def load_settings(config: Path | None = None, **overrides: Any) -> AgentSettings:
    """Settings from ``config`` (YAML) or ``$BULKHEAD_AGENT_CONFIG``, env and overrides."""
    path = config or os.environ.get(CONFIG_ENV)
    if not path:
        return AgentSettings(**overrides)
    if not Path(path).is_file():
        raise FileNotFoundError(f"agent config {path}: no such file")
    from_file = type(
        "AgentSettings",
        (AgentSettings,),
        {"model_config": {**AgentSettings.model_config, "yaml_file": str(path)}},
    )
    return from_file(**overrides)
