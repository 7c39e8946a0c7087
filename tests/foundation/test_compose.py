"""compose.yaml parses and wires the three services (and Prometheus / Grafana) the way the README says."""

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


DEEPWELL = {"token", "kvcache", "engine", "engine-cpu", "gateway"}  # the services that run a `deepwell` command
MONITORING = {"prometheus", "grafana"}


def test_services_and_commands(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == DEEPWELL | MONITORING
    known = {name for name, _ in cli.COMMANDS}
    for name, svc in services.items():
        if name in MONITORING:  # upstream images: no build, no deepwell command
            assert "build" not in svc and svc["image"].split(":")[0] in ("prom/prometheus", "grafana/grafana"), name
            continue
        assert svc["command"][0] == "deepwell" and svc["command"][1] in known, name
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert (REPO / svc["build"]["dockerfile"]).exists()
        if name == "token":  # a one-shot job: writes the token file, then exits
            continue
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


@pytest.mark.parametrize("service", ["kvcache", "engine", "engine-cpu", "gateway"])
def test_environment_names_real_settings(compose: dict, service: str) -> None:
    """Every DEEPWELL_* variable in compose.yaml is one the service's CLI reads."""
    svc = compose["services"][service]
    env = svc.get("environment", {})
    result = subprocess.run([sys.executable, "-m", "deepwell.cli", svc["command"][1], "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for key in env:
        if key.startswith("DEEPWELL_"):  # others (TRITON_*) are read by the libraries
            assert key in result.stdout, f"{service}: {key} is not a setting of 'deepwell {service}'"


def test_ports_are_loopback_only(compose: dict) -> None:
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_startup_order(compose: dict) -> None:
    services = compose["services"]
    assert services["engine"]["depends_on"]["kvcache"]["condition"] == "service_healthy"
    assert services["engine-cpu"]["depends_on"]["kvcache"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["engine"]["condition"] == "service_healthy"
    # the CPU engine is waited for when its profile is on, and no error when it is off
    assert services["gateway"]["depends_on"]["engine-cpu"] == {"condition": "service_healthy", "required": False}
    assert services["kvcache"]["depends_on"]["token"]["condition"] == "service_completed_successfully"


def test_cpu_engine_profile(compose: dict) -> None:
    """`docker compose --profile cpu up --scale engine=0`: the GPU engine's settings and volumes on
    the CPU, reachable as "engine" (the gateway's DEEPWELL_GATEWAY_ENGINES and Prometheus' target)."""
    services = compose["services"]
    gpu, cpu = services["engine"], services["engine-cpu"]
    assert cpu["profiles"] == ["cpu"] and "profiles" not in gpu
    assert "deploy" not in cpu  # no GPU reservation
    assert cpu["command"] == gpu["command"]
    assert cpu["environment"] == {**gpu["environment"], "DEEPWELL_ENGINE_DEVICE": "cpu"}
    assert cpu["volumes"] == gpu["volumes"]
    assert "engine" in cpu["networks"]["default"]["aliases"]
    assert services["gateway"]["environment"]["DEEPWELL_GATEWAY_ENGINES"] == "engine:50051"
    assert {k: v for k, v in cpu["healthcheck"].items() if k != "start_period"} == \
        {k: v for k, v in gpu["healthcheck"].items() if k != "start_period"}


def test_monitoring_services(compose: dict) -> None:
    """Prometheus scrapes each service where compose.yaml makes it serve metrics; Grafana gets the
    provisioning and the dashboard, read-only, from deploy/."""
    services = compose["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets = {job["job_name"]: (job.get("metrics_path", "/metrics"), job["static_configs"][0]["targets"])
               for job in config["scrape_configs"]}
    engine_env, daemon_env = services["engine"]["environment"], services["kvcache"]["environment"]
    gateway_env = services["gateway"]["environment"]
    assert engine_env["DEEPWELL_ENGINE_METRICS_HOST"] == "0.0.0.0"
    assert targets["deepwell-engine"] == ("/metrics", [f"engine:{engine_env['DEEPWELL_ENGINE_METRICS_PORT']}"])
    host, _, port = daemon_env["DEEPWELL_KVCACHE_METRICS_ADDRESS"].rpartition(":")
    assert host == "0.0.0.0" and targets["deepwell-kvcache"] == ("/metrics", [f"kvcache:{port}"])
    assert gateway_env["DEEPWELL_GATEWAY_HOST"] == "0.0.0.0"
    assert targets["deepwell-gateway"] == ("/metrics", [f"gateway:{gateway_env['DEEPWELL_GATEWAY_PORT']}"])
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    assert all(v.endswith(":ro") for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    assert (REPO / mounts["/var/lib/grafana/dashboards"] / "deepwell.json").is_file()
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/deepwell.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/var/lib/grafana/dashboards/")
    assert (REPO / "deploy/grafana/dashboards" / Path(home).name).is_file()
    datasource = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert datasource["datasources"][0]["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


def test_every_service_gets_the_internal_token(compose: dict) -> None:
    services = compose["services"]
    path = services["token"]["command"][-1]
    services_prefixes = (("kvcache", "KVCACHE"), ("engine", "ENGINE"), ("engine-cpu", "ENGINE"), ("gateway", "GATEWAY"))
    for name, prefix in services_prefixes:
        assert services[name]["environment"][f"DEEPWELL_{prefix}_INTERNAL_TOKEN_FILE"] == path, name
        assert "run:/run/deepwell" in services[name]["volumes"], name


def test_internal_token_command_creates_once_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "token"
    for _ in range(2):  # created, then kept
        assert cli.main(["internal-token", str(path)]) == 0
    first = path.read_text()
    assert cli.main(["internal-token", str(path)]) == 0 and path.read_text() == first
    path.chmod(0o644)
    assert cli.main(["internal-token", str(path)]) == 1


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker client not installed")
def test_docker_compose_config_accepts_it() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    for profile in ([], ["--profile", "cpu"]):  # the CPU engine's profile off, then on
        result = subprocess.run(["docker", "compose", "-f", str(REPO / "compose.yaml"), *profile, "config", "-q"],
                                capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, (profile, result.stderr)


def test_engine_kernel_cache_outlives_the_container(compose: dict) -> None:
    """Triton's compiled kernels and autotuning results live on a named volume the image's user
    owns: a recreated engine does not compile everything again."""
    engine = compose["services"]["engine"]
    cache = engine["environment"]["TRITON_CACHE_DIR"]
    assert engine["environment"]["TRITON_CACHE_AUTOTUNING"] == "1"
    mounts = dict(v.split(":")[:2] for v in engine["volumes"])
    assert "kernel-cache" in compose["volumes"] and cache.startswith(mounts["kernel-cache"] + "/")
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert mounts["kernel-cache"] in dockerfile.split("USER deepwell")[0]  # created and chowned before USER
