"""compose.yaml parses and wires the three services the way the README says."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deepwell import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def test_services_and_commands(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"kvcache", "engine", "gateway"}
    known = {name for name, _ in cli.COMMANDS}
    for name, svc in services.items():
        assert svc["command"][0] == "deepwell" and svc["command"][1] in known, name
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert (REPO / svc["build"]["dockerfile"]).exists()
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "deepwell.healthcheck"], name


def test_engine_reserves_gpus_and_shares_the_arena(compose: dict) -> None:
    services = compose["services"]
    devices = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    mounts = {s: {v.split(":")[0] for v in services[s]["volumes"]} for s in ("kvcache", "engine")}
    assert "arena" in mounts["kvcache"] & mounts["engine"]
    assert "run" in mounts["kvcache"] & mounts["engine"]  # the daemon's unix socket
    engine_env, daemon_env = services["engine"]["environment"], services["kvcache"]["environment"]
    assert engine_env["DEEPWELL_ENGINE_KV_DAEMON"] == daemon_env["DEEPWELL_KVCACHE_ADDRESS"]
    assert compose["volumes"]["arena"]["driver_opts"]["type"] == "tmpfs"


@pytest.mark.parametrize("service", ["kvcache", "engine", "gateway"])
def test_environment_names_real_settings(compose: dict, service: str) -> None:
    """Every DEEPWELL_* variable in compose.yaml is one the service's CLI reads."""
    env = compose["services"][service].get("environment", {})
    result = subprocess.run([sys.executable, "-m", "deepwell.cli", service, "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for key in env:
        assert key in result.stdout, f"{service}: {key} is not a setting of 'deepwell {service}'"


def test_ports_are_loopback_only(compose: dict) -> None:
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_startup_order(compose: dict) -> None:
    services = compose["services"]
    assert services["engine"]["depends_on"]["kvcache"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["engine"]["condition"] == "service_healthy"


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker client not installed")
def test_docker_compose_config_accepts_it() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    result = subprocess.run(["docker", "compose", "-f", str(REPO / "compose.yaml"), "config", "-q"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
