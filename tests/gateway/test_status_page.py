"""The status page ``GET /deepwell/status`` and its data endpoint ``GET /v1/deepwell/stats``.

The page and its assets are served without auth (they hold no data); the data endpoints it
reads follow the sessions view's admin-key rule. The last tests load the page in headless
Chromium (``--dump-dom``) against a live stack (a real engine process on a tiny hybrid model
and a gateway process) and read what it rendered; they skip where no Chromium is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deepwell.engine.v1 import engine_pb2
from deepwell.gateway.config import GatewayConfig
from deepwell.gateway.http import status_page
from deepwell.gateway.http.app import create_app
from tests.gateway import fake_engine
from tests.gateway.fake_engine import CHATML_TOOLS_TEMPLATE, FakeEngine, free_port

ADMIN, USER = "sk-ops-secret", "sk-alice-secret"
KEYS = (f"ops:{ADMIN}", f"alice:{USER}")
DATA_ENDPOINTS = ("/v1/deepwell/sessions", "/v1/deepwell/stats")


class _StatsServicer(fake_engine._Servicer):
    def Stats(self, request, context):  # noqa: N802
        return engine_pb2.EngineStats(
            requests_running=1, requests_waiting=2, kv_pages_used=10, kv_pages_total=40, state_slots_used=1,
            state_slots_total=6, tokens_prefilled=1000, tokens_decoded=2**40, requests_finished=5,
            cached_total=engine_pb2.CacheHits(resident_frontier=300, host_entry=20), uptime_s=12.5, device="fake",
            cache_entries=3, cache_pages=7)

    def Sessions(self, request, context):  # noqa: N802
        return engine_pb2.SessionsReply(engine_id=self.fake.engine_id)


@pytest.fixture
def engine(monkeypatch) -> Iterator[FakeEngine]:
    monkeypatch.setattr(fake_engine, "_Servicer", _StatsServicer)
    with FakeEngine() as fake:
        yield fake


def _client(engines: list[str], **kw) -> TestClient:
    return TestClient(create_app(GatewayConfig(engines=tuple(engines), grpc_listen="", **kw)))


# -- the page ----------------------------------------------------------------------------------
def test_page_and_assets_are_served_without_auth(engine: FakeEngine) -> None:
    with _client([engine.address], api_keys=KEYS, admin_keys=("ops",)) as client:
        page = client.get("/deepwell/status")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff"
        html = page.text
        assert '<script src="status.js"' in html and 'href="status.css"' in html and 'id="sessions"' in html
        assert "://" not in html  # no CDN, nothing external
        script = client.get("/deepwell/status.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert "../v1/deepwell/sessions" in script.text and "../v1/deepwell/stats" in script.text
        assert "innerHTML" not in script.text  # server values are rendered as text only
        assert re.findall(r"https?://[^\s\"'`]+", script.text) == ["http://www.w3.org/2000/svg"]
        style = client.get("/deepwell/status.css")
        assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
        assert client.get("/deepwell/status/../../pyproject.toml").status_code == 404
        assert client.get("/deepwell/other.js").status_code == 404


def test_assets_ship_as_package_data() -> None:
    """Every served file exists beside the module and is listed in pyproject's package data."""
    static = Path(status_page.__file__).parent / "static"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    data = re.search(r'^"deepwell\.gateway\.http" = \[(.*)\]$', pyproject, re.M)
    assert data, "pyproject.toml lacks [tool.setuptools.package-data] for deepwell.gateway.http"
    patterns = json.loads(f"[{data.group(1)}]")
    for name, _ in status_page.ASSETS.values():
        assert (static / name).is_file()
        assert any(Path("static", name).match(p) for p in patterns), (name, patterns)


# -- the stats endpoint ------------------------------------------------------------------------
def test_stats_merges_engines_and_reports_one_that_cannot_answer(engine: FakeEngine) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with _client([engine.address, dead]) as client:
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:  # the model is loaded
            time.sleep(0.02)
        r = client.get("/v1/deepwell/stats")
        assert r.status_code == 200, r.text
        body = r.json()
        ok, down = body["engines"]
        assert ok["ok"] and ok["address"] == engine.address and ok["model"] == "fake-model"
        s = ok["stats"]
        assert (s["tokens_prefilled"], s["tokens_decoded"], s["kv_pages_total"], s["uptime_s"]) == (
            1000, 2**40, 40, 12.5)  # 64-bit counters stay numbers
        assert s["cached_total"] == {"resident_frontier": 300, "resident_checkpoint": 0, "host_entry": 20,
                                     "session_lookup": 0, "shared_prefix": 0}
        assert (down["address"], down["ok"]) == (dead, False) and down["error"]
        t = body["totals"]
        assert (t["tokens_prefilled"], t["requests_running"], t["cached_tokens"]) == (1000, 1, 320)
        assert t["cache_hits"]["resident_frontier"] == 300
        g = body["gateway"]
        assert g["engines"] == 2 and set(g["tokens"]) == {"prompt", "completion", "cached"}
        assert g["requests"]["2xx"] >= 0 and g["uptime_s"] >= 0
        assert r.headers["cache-control"] == "no-store"


@pytest.mark.parametrize("path", DATA_ENDPOINTS)
def test_data_endpoints_follow_the_admin_key_rule(engine: FakeEngine, path: str) -> None:
    with _client([engine.address]) as client:  # no API keys: open
        assert client.get(path).status_code == 200
    with _client([engine.address], api_keys=KEYS) as client:  # keys on, no admin key set
        assert client.get(path).status_code == 401
        r = client.get(path, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 403 and "--admin-keys" in r.json()["error"]["message"]
    with _client([engine.address], api_keys=KEYS, admin_keys=("ops",)) as client:
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["message"]
        assert client.get(path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        r = client.get(path, headers={"Authorization": f"Bearer {USER}"})
        assert r.status_code == 403 and "'alice' is not an admin key" in r.json()["error"]["message"]
        assert client.get(path, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert client.get(path, headers={"x-api-key": ADMIN}).status_code == 200


# -- the page in a browser, against a live stack -----------------------------------------------
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome", "headless_shell")


def chromium_binary() -> str | None:
    """``$DEEPWELL_CHROMIUM`` or the first Chromium-like binary on PATH."""
    found = os.environ.get("DEEPWELL_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    return found if found and shutil.which(found) else None


def dump_dom(url: str, profile: Path, budget_ms: int = 6000) -> str:
    """The page's DOM once its fetches and ``budget_ms`` of virtual time have run (so at least two
    refreshes), as headless Chromium prints it."""
    browser = chromium_binary()
    assert browser
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}",
           f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "<html" in r.stdout, (r.returncode, r.stderr[-2000:])
    return r.stdout


def _rows(dom: str, table_id: str) -> list[str]:
    table = re.search(rf'<table id="{table_id}".*?</table>', dom, re.S)
    assert table, dom[:3000]
    body = re.search(r"<tbody>(.*?)</tbody>", table.group(0), re.S)
    return re.findall(r"<tr[^>]*>.*?</tr>", body.group(1) if body else "", re.S)


def _cells(row: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]


def _errors(dom: str) -> list[str]:
    box = re.search(r'<ul id="errors"[^>]*>(.*?)</ul>', dom, re.S)
    return [re.sub(r"<[^>]+>", "", li) for li in re.findall(r"<li>(.*?)</li>", box.group(1) if box else "", re.S)]


def _chat(url: str, session: str, text: str) -> dict:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 3,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", "X-Session-Id": session}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body, headers),
                                    timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"chat request failed: HTTP {exc.code}: {exc.read()[:500]!r}") from None


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A real engine (tiny qwen3_5) and two gateways: one open, one with API keys and an admin key.
    Yields their URLs and a scratch directory."""
    if chromium_binary() is None:
        pytest.skip("no chromium binary found (apt-get install chromium, or set DEEPWELL_CHROMIUM)")
    from tests.engine.helpers_models import make_hf
    from tests.engine.helpers_process import engine_process
    from tests.gateway.fake_engine import load_tokenizer, start_gateway, tokenizer_json

    tmp = tmp_path_factory.mktemp("status")
    model = tmp / "model"
    hf = make_hf("qwen3_5")
    hf.resize_token_embeddings(load_tokenizer().get_vocab_size())  # the chat template's ids fit the vocabulary
    hf.save_pretrained(model)
    (model / "tokenizer.json").write_text(tokenizer_json())
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                             "chat_template": CHATML_TOOLS_TEMPLATE}))
    with ExitStack() as stack:
        (tmp / "engine").mkdir()
        address, _ = stack.enter_context(engine_process(tmp / "engine", [
            "--model", str(model), "--num-pages", "40", "--page-size", "16", "--max-concurrency", "2",
            "--cpu-threads", "1", "--log-level", "warning"]))
        open_gw = start_gateway([address], str(tmp), timeout_s=120)
        stack.callback(open_gw.stop)
        keyed_gw = start_gateway([address], str(tmp), "--api-keys", ",".join(KEYS), "--admin-keys", "ops",
                                 timeout_s=120)
        stack.callback(keyed_gw.stop)
        yield open_gw.url, keyed_gw.url, tmp


def test_browser_renders_the_sessions_table(live: tuple[str, str, Path]) -> None:
    url, _, tmp = live
    _chat(url, "status-a", "Hello there, how are you?")
    _chat(url, "<b>bold</b>", "A second conversation.")  # a client-chosen key is shown as text
    dom = dump_dom(url + "/deepwell/status", tmp / "profile-open")
    assert _errors(dom) == [], _errors(dom)
    assert 'data-state="ok"' in dom
    rows = {_cells(r)[0]: _cells(r) for r in _rows(dom, "sessions") if 'class="session-row' in r}
    assert "status-a" in rows, dom[:4000]
    a = rows["status-a"]
    assert a[1] == "default" and a[2] == "GPU" and int(a[3].replace(",", "")) > 0 and a[5].endswith(" ms")
    assert "&lt;b&gt;bold&lt;/b&gt;" in rows and "<b>bold</b>" not in dom  # escaped, never markup
    hits = [_cells(r) for r in _rows(dom, "hits")]
    assert [h[0] for h in hits] == ["resident frontier", "resident checkpoint", "host entry", "session lookup",
                                    "shared prefix", "all levels"]
    engines = [_cells(r) for r in _rows(dom, "engines")]
    assert len(engines) == 1 and engines[0][3] == "healthy" and engines[0][2] == "cpu"
    for figure in ("rate-prefill", "rate-decode"):  # a number once two samples lie >= 1 s apart
        value = re.search(rf'id="{figure}"[^>]*>([^<]*)<', dom)
        assert value and re.fullmatch(r"[\d.,]+|…", value.group(1)), value
    assert re.search(r'id="requests-now"[^>]*>\d+ / \d+<', dom)


def test_browser_shows_auth_errors_and_asks_for_a_key(live: tuple[str, str, Path]) -> None:
    _, url, tmp = live
    dom = dump_dom(url + "/deepwell/status", tmp / "profile-keyed", budget_ms=1000)
    errors = _errors(dom)
    assert any("GET /v1/deepwell/sessions: HTTP 401" in e for e in errors), errors
    assert any("GET /v1/deepwell/stats: HTTP 401" in e for e in errors), errors
    assert re.search(r'<form id="key-form"[^>]*class="needed"', dom) and 'data-state="error"' in dom
