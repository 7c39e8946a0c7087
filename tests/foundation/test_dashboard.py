"""The Grafana dashboard of the compose stack (deploy/grafana/dashboards/deepwell.json).

- It is valid Grafana JSON: every panel has a type, a title and a place on the grid, and every
  query names the provisioned Prometheus datasource.
- Every metric its PromQL names is one the services export: declared by their metrics modules,
  and present in the ``/metrics`` of a real KV-cache daemon, engine (SmolLM2 on the CPU, nvfp4
  KV, prefix cache with the daemon as its host tier) and gateway after a few chat requests.
- With a ``prometheus`` binary (CI installs Debian's), real Prometheus scrapes that stack with
  deploy/prometheus/prometheus.yml (targets and interval rewritten for the test) and every
  dashboard expression returns at least one series.

One stack serves the whole module (~40 s on 2 cores, most of it the engine's start).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy/grafana/dashboards/deepwell.json"
DATASOURCES = REPO / "deploy/grafana/provisioning/datasources/prometheus.yml"
PROMETHEUS_CONFIG = REPO / "deploy/prometheus/prometheus.yml"
# Grafana's variables, as the Prometheus HTTP API needs them (the window covers the test's traffic)
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

# -- PromQL: the metric names an expression uses --------------------------------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions or aggregations (followed by
    ``(``), keywords, label names (in ``{...}`` matchers and ``by`` / ``on`` / ... lists) or durations."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, endpoint) (rate(deepwell_gateway_ttft_seconds_bucket'
            '{endpoint=~"chat.*", status!="5.."}[$__rate_interval]))) / on (kv) group_left '
            'sum by (kv) (x_total offset 5m) > bool 1e-3 or vector(0) and clamp_min(y, 1)')
    assert metric_names(expr) == {"deepwell_gateway_ttft_seconds_bucket", "x_total", "y"}
    assert metric_names("sum(rate(a_total[5m])) by (endpoint)") == {"a_total"}


# -- the dashboard ---------------------------------------------------------------------------------------------
def provisioned_uid() -> str:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus"
    return source["uid"]


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row keeps its panels
    return out


def expressions() -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])]


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    uid = provisioned_uid()
    assert dashboard["title"] and dashboard["uid"] and dashboard.get("id") is None
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert isinstance(dashboard["templating"]["list"], list) and dashboard["time"]["from"]
    panels = all_panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    queries = 0
    for p in panels:
        assert p["type"] in {"row", "timeseries", "stat", "gauge", "bargauge", "table"}, p
        assert isinstance(p["title"], str) and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["w"] >= 1 and g["h"] >= 1 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            assert "targets" not in p and isinstance(p["panels"], list), p["title"]
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == uid and isinstance(t["expr"], str) and t["expr"].strip(), p["title"]
            names = metric_names(t["expr"])
            assert names and all(n.startswith("deepwell_") for n in names), (p["title"], t["expr"], names)
            queries += 1
    assert queries >= 20
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("requests", "errors", "time to first token", "inter-token", "tokens per second", "running",
                  "kv pages", "reuse level", "cached fraction", "spills", "latency", "host arena", "evictions",
                  "kv scales", "tool-call"):
        assert topic in titles, f"no panel about {topic}"


def exposition_names(text: str) -> set[str]:
    """Metric names of a Prometheus text exposition: every sample's, and those ``# HELP`` / ``# TYPE``
    declare (a family without samples yet, e.g. labelled and never observed: histograms expand to
    ``_bucket`` / ``_sum`` / ``_count``)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind in ("histogram", "summary"):
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line.startswith("# HELP "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def test_dashboard_metrics_are_declared_by_the_metrics_modules() -> None:
    """Fast and static: a fresh registry of each service declares every name the dashboard uses."""
    from prometheus_client import generate_latest

    from deepwell.engine_service.metrics import EngineMetrics
    from deepwell.gateway.metrics import GatewayMetrics
    from deepwell.kvcache_daemon.metrics import Metrics

    declared = set()
    for registry in (EngineMetrics("m").registry, Metrics().registry, GatewayMetrics().registry):
        declared |= exposition_names(generate_latest(registry).decode())
    missing = {(where, n) for where, expr in expressions() for n in metric_names(expr) if n not in declared}
    assert not missing, sorted(missing)


# -- the real stack ---------------------------------------------------------------------------------------------
@dataclass
class Stack:
    metrics: dict[str, str]  # Prometheus job name -> /metrics URL
    gateway: str
    prometheus: str | None  # the API's base URL when a prometheus binary runs
    traffic_done: float  # time.time() when the last request had finished


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _query(prometheus: str, expr: str) -> list[dict]:
    body = _get_json(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", body
    return body["data"]["result"]


@contextmanager
def prometheus_process(run_dir: Path, targets: dict[str, str]) -> Iterator[str]:
    """Real Prometheus with the compose stack's config, its targets replaced by ``targets`` (job -> host:port)
    and a 1 s scrape interval; yields the base URL once every target is up."""
    from tests.gateway.fake_engine import _die_with_parent, free_port

    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    (run_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(run_dir / "prometheus.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={run_dir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={run_dir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (run_dir / "prometheus.log").read_text()[-3000:]
            try:
                up = _query(url, "up")
                if len(up) == len(targets) and all(r["value"][1] == "1" for r in up):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, ((run_dir / "prometheus.log").read_text()[-3000:], targets)
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def drive(gateway: str) -> None:
    """Two conversations of two turns, interleaved (A1 B1 A2 B2): with the resident budget at 0 every ended
    sequence is spilled to the daemon, so the second turns are restored from the host tier; one has tools
    (tool-parse outcomes), one streams; then a malformed request (a 400 for the errors panel)."""
    from tests.gateway.fake_engine import WEATHER_TOOL

    convs = {"a": [{"role": "user", "content": "Name three colors."}],
             "b": [{"role": "user", "content": "What is the weather in Rome?"}]}
    with httpx.Client(base_url=gateway, timeout=120) as client:
        for turn in range(2):
            for key, messages in convs.items():
                body: dict = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
                if key == "b":
                    body["tools"] = [WEATHER_TOOL]
                if key == "a" and turn == 1:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200, r.read()
                        text = "".join(r.iter_text())
                    assert "[DONE]" in text
                    continue
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"},
                             {"role": "user", "content": "And three more?"}]
        assert client.post("/v1/chat/completions", json={"model": "m"}).status_code == 400


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        from tests.engine.fixtures_smollm2 import smollm2_gguf_path

        model = smollm2_gguf_path()
    except Exception as exc:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    from tests.engine.helpers_process import engine_process
    from tests.gateway.fake_engine import free_port, start_gateway
    from tests.kvcache.kvtest_helpers import Daemon

    tmp = tmp_path_factory.mktemp("dashboard")
    daemon_metrics = f"127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        daemon = Daemon(extra=["--metrics-address", daemon_metrics]).start()
        stack.callback(daemon.cleanup)
        (tmp / "engine").mkdir()
        address, engine_metrics = stack.enter_context(engine_process(tmp / "engine", [
            "--model", str(model), "--num-pages", "16", "--kv-dtype", "nvfp4", "--max-concurrency", "2",
            "--cpu-threads", "1", "--log-level", "warning", "--prefix-cache", "on", "--kv-daemon", daemon.address,
            "--cache-fraction", "0"]))
        gw = start_gateway([address], str(tmp), "--tool-parser", "hermes_json", timeout_s=120)
        stack.callback(gw.stop)
        metrics = {"deepwell-engine": engine_metrics, "deepwell-kvcache": f"http://{daemon_metrics}/metrics",
                   "deepwell-gateway": f"{gw.url}/metrics"}
        prometheus = None
        if shutil.which("prometheus"):  # scraping before the traffic: the rates see it happen
            (tmp / "prometheus").mkdir()
            targets = {job: urllib.parse.urlsplit(url).netloc for job, url in metrics.items()}
            prometheus = stack.enter_context(prometheus_process(tmp / "prometheus", targets))
        drive(gw.url)
        yield Stack(metrics, gw.url, prometheus, time.time())


def test_dashboard_metrics_exist_in_the_services_scrapes(stack: Stack) -> None:
    scraped = set()
    for url in stack.metrics.values():
        with urllib.request.urlopen(url, timeout=10) as r:
            scraped |= exposition_names(r.read().decode())
    missing = {(where, n) for where, expr in expressions() for n in metric_names(expr) if n not in scraped}
    assert not missing, sorted(missing)
    # the traffic reached the host tier: spills, restores and a host-level hit have samples
    with urllib.request.urlopen(stack.metrics["deepwell-engine"], timeout=10) as r:
        engine = r.read().decode()
    for sample in ('deepwell_engine_cache_spills_total{model=', 'deepwell_engine_cache_restores_total{model=',
                   'deepwell_engine_kv_served_scales_total{kind="total",kv="k"'):
        assert sample in engine, sample


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (apt-get install prometheus)")
def test_every_dashboard_expression_returns_data_in_prometheus(stack: Stack) -> None:
    assert stack.prometheus is not None
    # every target scraped again after the traffic
    deadline = time.monotonic() + 30
    while True:
        up = _query(stack.prometheus, "timestamp(up)")
        if len(up) == len(stack.metrics) and min(float(r["value"][1]) for r in up) > stack.traffic_done + 1:
            break
        assert time.monotonic() < deadline, up
        time.sleep(0.2)
    empty, values = [], {}
    for where, expr in expressions():
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        result = _query(stack.prometheus, expr)
        if not result:
            empty.append((where, expr))
        values[where] = [float(r["value"][1]) for r in result]
    assert not empty, empty
    # the traffic shows: requests were counted, tokens were decoded, prompt tokens came from the cache
    finite = {where: [v for v in vs if not math.isnan(v)] for where, vs in values.items()}
    assert max(finite["Requests by endpoint / A"]) > 0
    assert max(finite["Prefill / decode tokens per second / B"]) > 0
    assert max(finite["Cached fraction / A"]) > 0
