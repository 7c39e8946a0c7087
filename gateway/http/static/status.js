// deepwell status page: polls GET /v1/deepwell/sessions and GET /v1/deepwell/stats and renders them.
// Plain JS, no dependencies. Every value from the server is rendered as text (textContent), never
// as HTML. The admin key (when the gateway has API keys) lives in this tab's sessionStorage and is
// sent as an Authorization: Bearer header to this gateway only.
"use strict";
(() => {
  const REFRESH_MS = 2000;
  const HISTORY = 90;  // samples kept for the sparkline
  const KEY_STORE = "deepwell.status.adminKey";
  const SESSIONS_URL = "../v1/deepwell/sessions";
  const STATS_URL = "../v1/deepwell/stats";
  const LEVELS = [["resident_frontier", "resident frontier"], ["resident_checkpoint", "resident checkpoint"],
    ["host_entry", "host entry"], ["session_lookup", "session lookup"], ["shared_prefix", "shared prefix"]];
  const WHERE = { resident: "GPU", host: "host", both: "GPU+host", none: "–" };
  const HOST_FIELD = /(^|_)(host|daemon|arena|kvcache)(_|$)/;  // engine Stats fields about the host tier

  const $ = (id) => document.getElementById(id);
  const MIN_WINDOW_S = 1.0;     // shortest span a rate is measured over
  const previous = new Map();  // engine address -> its baseline counters {uptime, prefilled, decoded}
  const rates = new Map();     // engine address -> its latest {prefill, decode} tokens per second
  const history = [];          // {prefill, decode} tokens per second, oldest first
  let scriptErrors = [];

  class FetchError extends Error {
    constructor(message, status) { super(message); this.status = status; }
  }

  // -- formatting -------------------------------------------------------------------------
  function humanBytes(n) {
    if (n === null || n === undefined) return "–";
    if (Math.abs(n) < 1024) return `${Math.trunc(n)} B`;
    let unit = "B";
    for (const u of ["KiB", "MiB", "GiB", "TiB"]) {
      n /= 1024; unit = u;
      if (Math.abs(n) < 1024) break;
    }
    return `${n.toFixed(1)} ${unit}`;
  }
  function humanDuration(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s >= 10 ? `${s.toFixed(0)}s` : `${s.toFixed(1)}s`;
    const pad = (x) => String(Math.trunc(x)).padStart(2, "0");
    if (s < 3600) return `${Math.trunc(s / 60)}m${pad(s % 60)}s`;
    if (s < 86400) return `${Math.trunc(s / 3600)}h${pad((s % 3600) / 60)}m`;
    return `${Math.trunc(s / 86400)}d${pad((s % 86400) / 3600)}h`;
  }
  const int = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
  function rate(x) {
    if (x === null || x === undefined) return "–";
    return x >= 100 ? int(x) : x.toFixed(1);
  }

  // -- DOM helpers (text only) -------------------------------------------------------------
  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "–" : String(text);
    if (cls) td.className = cls;
    return td;
  }
  function bar(used, total) {  // a cell holding a bar filled to used / total
    const td = document.createElement("td");
    const outer = document.createElement("span");
    outer.className = "meter";
    const fill = document.createElement("span");
    fill.style.width = `${total ? Math.min(100, (100 * used) / total) : 0}%`;
    outer.appendChild(fill);
    td.appendChild(outer);
    return td;
  }
  function meter(used, total) {  // the bar and "used / total"
    const td = bar(used, total);
    td.appendChild(document.createTextNode(`${int(used)} / ${int(total)}`));
    return td;
  }
  function fillBody(table, rows, columns, emptyText) {
    const tbody = table.tBodies[0];
    tbody.replaceChildren(...rows);
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = cell(emptyText, "dim");
      td.colSpan = columns;
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
  }
  function showErrors(messages) {
    const items = [...messages, ...scriptErrors].map((m) => {
      const li = document.createElement("li");
      li.textContent = m;
      return li;
    });
    $("errors").replaceChildren(...items);
  }

  // -- fetching ----------------------------------------------------------------------------
  async function getJSON(url) {
    const headers = { Accept: "application/json" };
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = `Bearer ${key}`;
    const path = new URL(url, location.href).pathname;
    let resp;
    try {
      resp = await fetch(url, { headers, cache: "no-store", credentials: "omit", redirect: "error" });
    } catch (exc) {
      throw new FetchError(`cannot reach the gateway (GET ${path}): ${exc.message}`, 0);
    }
    let body = null;
    try { body = await resp.json(); } catch (exc) { body = null; }
    if (!resp.ok) {
      const message = (body && body.error && body.error.message) || resp.statusText || "no message";
      throw new FetchError(`GET ${path}: HTTP ${resp.status}: ${message}`, resp.status);
    }
    if (body === null || typeof body !== "object") throw new FetchError(`GET ${path}: the answer is not JSON`, 0);
    return body;
  }

  // -- sections ----------------------------------------------------------------------------
  function renderSessions(data) {
    const rows = (data.data || []).map((r) => {
      const tr = document.createElement("tr");
      tr.className = "session-row" + (r.requests_running ? " running" : "");
      tr.dataset.session = r.session_key || "";
      const turn = r.last_turn;
      tr.append(
        cell(r.session || r.session_key), cell(r.tenant), cell(WHERE[r.placement] || "–"),
        cell(int(r.cached_tokens), "num"),
        cell(turn ? `${pct(turn.cached_fraction)} of ${int(turn.prompt_tokens)}` : "–", "num"),
        cell(turn && turn.ttft_ms ? `${turn.ttft_ms.toFixed(1)} ms` : "–", "num"),
        cell(humanDuration(r.age_s), "num"), cell(humanDuration(r.idle_s), "num"),
        cell(humanBytes(r.bytes), "num"), cell(r.engine));
      return tr;
    });
    fillBody($("sessions"), rows, 10, "no sessions yet (requests with a session key appear here)");
    $("sessions-count").textContent = `(${rows.length})`;
    return (data.engines || []).filter((e) => !e.ok).map((e) => `engine ${e.address}: sessions: ${e.error}`);
  }

  function renderHits(stats) {
    const hits = (stats.totals && stats.totals.cache_hits) || {};
    const total = LEVELS.reduce((sum, [level]) => sum + (hits[level] || 0), 0);
    const rows = LEVELS.map(([level, label]) => {
      const n = hits[level] || 0;
      const tr = document.createElement("tr");
      tr.append(cell(label), cell(int(n), "num"), cell(total ? pct(n / total) : "–", "num"), bar(n, total));
      return tr;
    });
    const sum = document.createElement("tr");
    sum.append(cell("all levels"), cell(int(total), "num"), cell("", "num"), cell(""));
    fillBody($("hits"), [...rows, sum], 4, "");
    const tok = (stats.gateway && stats.gateway.tokens) || {};
    $("hits-note").textContent = tok.prompt
      ? `Prompt tokens through this gateway: ${int(tok.prompt)}, of which cached ${int(tok.cached)} ` +
        `(${pct(tok.cached / tok.prompt)}); engines' totals since they started.`
      : "No prompt tokens through this gateway yet; engines' totals since they started.";
  }

  // Rates per engine over at least MIN_WINDOW_S of its own clock (uptime_s): a sample closer to the
  // previous one than that keeps the older baseline. A counter or uptime that went down means the
  // engine restarted: the sample becomes the new baseline.
  function renderThroughput(stats) {
    let measured = false;
    const seen = new Set();
    for (const e of stats.engines || []) {
      if (!e.ok) continue;
      const s = e.stats;
      const now = { uptime: s.uptime_s, prefilled: s.tokens_prefilled, decoded: s.tokens_decoded };
      const before = previous.get(e.address);
      seen.add(e.address);
      if (!before || now.uptime < before.uptime || now.prefilled < before.prefilled || now.decoded < before.decoded) {
        previous.set(e.address, now);
        rates.delete(e.address);
        continue;
      }
      const dt = now.uptime - before.uptime;
      if (dt < MIN_WINDOW_S) continue;
      previous.set(e.address, now);
      rates.set(e.address, { prefill: (now.prefilled - before.prefilled) / dt,
        decode: (now.decoded - before.decoded) / dt });
      measured = true;
    }
    for (const address of [...previous.keys()]) {
      if (!seen.has(address)) { previous.delete(address); rates.delete(address); }
    }
    const t = stats.totals || {};
    $("requests-now").textContent = `${int(t.requests_running)} / ${int(t.requests_waiting)}`;
    if (!rates.size) {
      $("rate-prefill").textContent = "…";
      $("rate-decode").textContent = "…";
      return;
    }
    let prefill = 0, decode = 0;
    for (const r of rates.values()) { prefill += r.prefill; decode += r.decode; }
    $("rate-prefill").textContent = rate(prefill);
    $("rate-decode").textContent = rate(decode);
    if (!measured) return;
    history.push({ prefill, decode });
    if (history.length > HISTORY) history.shift();
    drawSpark();
  }

  function drawSpark() {
    const svg = $("spark");
    const top = Math.max(1, ...history.map((h) => Math.max(h.prefill, h.decode)));
    const lines = ["prefill", "decode"].map((kind) => {
      const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
      line.setAttribute("class", kind);
      const step = 300 / Math.max(1, HISTORY - 1);
      const x0 = 300 - step * (history.length - 1);
      line.setAttribute("points", history.map((h, i) =>
        `${(x0 + i * step).toFixed(1)},${(58 - (56 * h[kind]) / top).toFixed(1)}`).join(" "));
      return line;
    });
    svg.replaceChildren(...lines);
    $("spark-span").textContent = `last ${humanDuration((history.length * REFRESH_MS) / 1000)}, ` +
      `peak ${rate(top)} tok/s`;
  }

  function renderEngines(stats) {
    const rows = (stats.engines || []).map((e) => {
      const tr = document.createElement("tr");
      if (!e.ok) {
        tr.append(cell(e.address), cell("–"), cell("–"), cell("unreachable", "bad"));
        const td = cell(e.error, "bad");
        td.colSpan = 8;
        tr.appendChild(td);
        return tr;
      }
      const s = e.stats;
      tr.append(cell(e.address), cell(e.model), cell(s.device),
        cell(e.healthy ? "healthy" : "unhealthy", e.healthy ? "ok" : "bad"),
        cell(int(s.requests_running), "num"), cell(int(s.requests_waiting), "num"),
        meter(s.kv_pages_used, s.kv_pages_total), meter(s.state_slots_used, s.state_slots_total),
        cell(`${int(s.cache_entries)} (${int(s.cache_pages)} pages)`, "num"),
        cell(int(s.tokens_prefilled), "num"), cell(int(s.tokens_decoded), "num"),
        cell(humanDuration(s.uptime_s), "num"));
      return tr;
    });
    fillBody($("engines"), rows, 12, "no engines configured");
    return (stats.engines || []).filter((e) => !e.ok).map((e) => `engine ${e.address}: stats: ${e.error}`);
  }

  function hostFields(s) {
    return Object.entries(s).filter(([name, value]) => HOST_FIELD.test(name) && value !== null);
  }
  function kvList(entries) {
    const dl = document.createElement("dl");
    dl.className = "kv";
    for (const [name, value] of entries) {
      const dt = document.createElement("dt");
      dt.textContent = name.replaceAll("_", " ");
      const dd = document.createElement("dd");
      if (value !== null && typeof value === "object") dd.appendChild(kvList(Object.entries(value)));
      else dd.textContent = /bytes$/.test(name) ? humanBytes(value) : typeof value === "number" ? int(value) : value;
      dl.append(dt, dd);
    }
    return dl;
  }

  function renderHost(stats, sessions) {
    const box = $("host");
    const parts = [];
    for (const e of (stats && stats.engines) || []) {
      if (!e.ok) continue;
      const fields = hostFields(e.stats);
      if (!fields.length) continue;
      const head = document.createElement("div");
      head.className = "small dim";
      head.textContent = `engine ${e.address}`;
      parts.push(head, kvList(fields));
    }
    box.className = parts.length ? "" : "small";
    if (!parts.length) {
      const note = document.createElement("p");
      note.className = "dim";
      const command = document.createElement("code");
      command.textContent = "deepwell stats --daemon-address ADDR";
      if (stats) {
        note.append("No host tier reported: the engines run without --kv-daemon, or the daemon does not answer (",
          command, " asks it directly).");
      } else {
        note.textContent = "No engine stats (see the errors above).";
      }
      parts.push(note);
    }
    if (sessions) {
      let entries = 0, tokens = 0, bytes = 0, spilled = 0;
      for (const r of sessions.data || []) {
        entries += r.host_entries || 0;
        tokens += r.host_tokens || 0;
        bytes += r.host_bytes || 0;
        if (r.placement === "host" || r.placement === "both") spilled += 1;
      }
      const head = document.createElement("div");
      head.className = "small dim";
      head.textContent = "Spilled to the daemon by the listed sessions (as the engines see it):";
      parts.push(head, kvList([["sessions on the host", spilled], ["host entries", entries],
        ["host tokens (longest prefix per session)", tokens], ["host bytes", bytes]]));
    }
    box.replaceChildren(...parts);
  }

  // -- the loop ----------------------------------------------------------------------------
  async function refresh() {
    const [sessions, stats] = await Promise.allSettled([getJSON(SESSIONS_URL), getJSON(STATS_URL)]);
    const errors = [];
    let authNeeded = false;
    const failed = (result) => {
      const err = result.reason;
      errors.push(err && err.message ? err.message : String(err));
      if (err && (err.status === 401 || err.status === 403)) authNeeded = true;
    };
    const guard = (label, fn) => {
      try { return fn() || []; } catch (exc) { errors.push(`${label}: cannot render: ${exc.message}`); return []; }
    };
    if (sessions.status === "fulfilled") errors.push(...guard("sessions", () => renderSessions(sessions.value)));
    else failed(sessions);
    if (stats.status === "fulfilled") {
      errors.push(...guard("engines", () => renderEngines(stats.value)));
      guard("cache hits", () => renderHits(stats.value));
      guard("throughput", () => renderThroughput(stats.value));
    } else {
      failed(stats);
    }
    guard("host tier", () => renderHost(stats.value, sessions.value));
    $("key-form").classList.toggle("needed", authNeeded);
    const stamp = new Date().toLocaleTimeString();
    $("updated").textContent = errors.length ? `last try ${stamp}: ${errors.length} problem(s), see below`
      : `updated ${stamp}`;
    document.body.dataset.state = errors.length ? "error" : "ok";
    showErrors(errors);
  }

  async function loop() {
    try {
      await refresh();
    } catch (exc) {
      showErrors([`status page error: ${exc.message}`]);
    }
    setTimeout(loop, REFRESH_MS);
  }

  function keyState() {
    $("key-state").textContent = sessionStorage.getItem(KEY_STORE) ? "key set (this tab only)"
      : "no key (kept in this tab only)";
  }

  function start() {
    $("every").textContent = String(REFRESH_MS / 1000);
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("key-input").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      $("key-input").value = "";
      keyState();
      refresh();
    });
    $("key-forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      keyState();
      refresh();
    });
    keyState();
    loop();
  }

  const report = (message) => {
    scriptErrors = [...scriptErrors.slice(-4), `status page error: ${message}`];
    showErrors([]);
  };
  window.addEventListener("error", (ev) => report(ev.message));
  window.addEventListener("unhandledrejection", (ev) => report(ev.reason && ev.reason.message || String(ev.reason)));
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
