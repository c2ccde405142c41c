"""Settings: the shipped DaemonSet config loads, env overrides it, typos are rejected."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from bulkhead.agent.detect.persistence import Window
from bulkhead.agent.settings import CONFIG_ENV, load_settings

REPO = Path(__file__).resolve().parents[2]


def test_deployed_config_loads_and_env_overrides(tmp_path, monkeypatch):
    configmap = yaml.safe_load((REPO / "deploy/agent/config.yaml").read_text())
    path = tmp_path / "agent.yaml"
    path.write_text(configmap["data"]["agent.yaml"])
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.setenv("BULKHEAD_AGENT_HEALTHY_PERIOD_S", "30")
    monkeypatch.setenv("BULKHEAD_AGENT_PERSISTENCE__THERMALTHROTTLE__K", "4")
    monkeypatch.setenv("BULKHEAD_AGENT_PERSISTENCE__THERMALTHROTTLE__N", "8")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    settings = load_settings(path)
    assert settings.node_name == "gpu-node-7"
    assert settings.proc_root == Path("/host/proc")
    assert settings.healthy_period_s == 30
    windows = settings.windows()
    assert windows["ThermalThrottle"] == Window(4, 8)
    assert windows["PowerThrottle"] == Window(3, 5)  # defaults kept for the others


def test_bad_settings_name_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ValidationError, match="interval_s"):
        load_settings(interval_s=0)
    with pytest.raises(ValidationError, match=r"k .* must be <= n"):
        load_settings(persistence={"Hang": {"k": 3, "n": 2}})
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml"):
        load_settings()
