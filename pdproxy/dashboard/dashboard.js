// pdproxy fleet dashboard: polls dashboard/data every second and renders it.
// Plain JS, no library, nothing fetched but this origin's JSON. Every string from the
// server goes through textContent (instance names come from registrations).
"use strict";

(function () {
  const POLL_MS = 1000;
  const HIDDEN_POLL_MS = 5000; // a background tab polls less often
  const STALE_AFTER_MS = 4000; // no answer for this long: the header says so
  const KEY_STORE = "pdproxy.dashboard.key";
  const SVG = "http://www.w3.org/2000/svg"; // a namespace name, never fetched

  const $ = (sel) => document.querySelector(sel);
  let lastOk = 0;
  let timer = null;
  let polling = false;

  // ---- formatting: every number with its unit ----

  function fixed(x, digits) {
    return x.toFixed(digits).replace(/\.0+$/, "");
  }

  function rate(x) {
    if (x === null || x === undefined) return "—";
    if (x === 0) return "0";
    if (x < 0.1) return x.toFixed(3);
    if (x < 10) return x.toFixed(2);
    if (x < 100) return x.toFixed(1);
    return Math.round(x).toLocaleString("en-US");
  }

  function duration(seconds) {
    // [number, unit]
    if (seconds === null || seconds === undefined) return ["—", ""];
    if (seconds < 1) return [fixed(seconds * 1000, seconds < 0.01 ? 1 : 0), "ms"];
    if (seconds < 100) return [fixed(seconds, 2), "s"];
    return [Math.round(seconds).toString(), "s"];
  }

  function percent(ratio) {
    if (ratio === null || ratio === undefined) return "—";
    const p = ratio * 100;
    return (p > 0 && p < 1 ? p.toFixed(1) : Math.round(p).toString()) + " %";
  }

  function uptime(seconds) {
    const s = Math.floor(seconds);
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }

  function count(n) {
    return Number.isInteger(n) ? n.toString() : fixed(n, 1);
  }

  // ---- DOM helpers ----

  const el = window.PdproxyDom.el; // dom.js

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }

  function setText(sel, text) {
    const node = $(sel);
    if (node.textContent !== text) node.textContent = text;
  }

  // ---- sparklines: inline SVG, one point per series step, gaps where there is no value ----

  // The x axis covers the history there is (at least MIN_SPARK_S, at most the series' span),
  // so a fresh pdproxy's first seconds are not squeezed into the right edge.
  const MIN_SPARK_S = 20;

  function sparkDomain(series) {
    const oldest = series.t.length ? -series.t[0] + series.step_seconds : 0;
    return Math.min(series.span_seconds, Math.max(MIN_SPARK_S, oldest));
  }

  function spanText(seconds) {
    return seconds >= 120 ? "last " + Math.round(seconds / 60) + " min" : "last " + Math.round(seconds) + " s";
  }

  function sparkline(target, t, values, span) {
    const w = 300;
    const h = 40;
    const pad = 2;
    const finite = values.filter((v) => v !== null && v !== undefined);
    const top = Math.max(...finite, 0) || 1;
    const x = (ti) => ((ti + span) / span) * w;
    const y = (v) => h - pad - (v / top) * (h - 2 * pad);
    let line = "";
    let area = "";
    let run = [];
    const flush = () => {
      if (run.length === 0) return;
      const pts = run.length === 1 ? [run[0], [run[0][0] + 2, run[0][1]]] : run;
      line += "M" + pts.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join("L");
      area += "M" + pts[0][0].toFixed(1) + "," + h + "L" +
        pts.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join("L") +
        "L" + pts[pts.length - 1][0].toFixed(1) + "," + h + "Z";
      run = [];
    };
    for (let i = 0; i < values.length; i++) {
      if (values[i] === null || values[i] === undefined || t[i] < -span) flush();
      else run.push([x(t[i]), y(values[i])]);
    }
    flush();
    target.replaceChildren(
      svg("line", { class: "base", x1: 0, y1: h - 0.5, x2: w, y2: h - 0.5 }),
      svg("path", { class: "area", d: area }),
      svg("path", { class: "line", d: line }),
    );
    target.dataset.points = finite.length;
  }

  // ---- headline figures ----

  function renderKpis(data) {
    const win = data.window;
    const minutes = win.seconds >= 59 ? "last minute" : "last " + Math.round(win.seconds) + " s";
    setText('[data-kpi="rate"]', rate(win.requests_per_second));
    setText('[data-note="rate"]', count(win.requests) + " requests · " + minutes);

    setText('[data-kpi="errors"]', rate(win.errors_per_second));
    const outcomes = Object.entries(win.errors_by_outcome)
      .sort((a, b) => b[1] - a[1])
      .map(([name, n]) => name + " " + count(n));
    setText(
      '[data-note="errors"]',
      percent(win.error_ratio) + " of requests" + (outcomes.length ? " · " + outcomes.join(", ") : ""),
    );
    $('[data-card="errors"]').classList.toggle("alert", win.errors > 0);

    for (const q of ["p50", "p99"]) {
      const [num, unit] = duration(win["ttft_" + q + "_seconds"]);
      setText('[data-kpi="' + q + '"]', num);
      setText('[data-unit="' + q + '"]', unit);
      setText(
        '[data-note="' + q + '"]',
        win["ttft_" + q + "_seconds"] === null ? "no first byte in the " + minutes : minutes,
      );
    }

    const s = data.series;
    const domain = sparkDomain(s);
    const charts = [
      ["rate", s.requests_per_second, (v) => rate(v) + " req/s"],
      ["errors", s.errors_per_second, (v) => rate(v) + " err/s"],
      ["p50", s.ttft_p50_seconds, (v) => duration(v).join(" ")],
      ["p99", s.ttft_p99_seconds, (v) => duration(v).join(" ")],
    ];
    for (const [name, values, unit] of charts) {
      sparkline($('[data-spark="' + name + '"]'), s.t, values, domain);
      const finite = values.filter((v) => v !== null);
      setText('[data-span="' + name + '"]', s.t.length ? spanText(domain) : "collecting…");
      setText('[data-peak="' + name + '"]', finite.length ? "peak " + unit(Math.max(...finite)) : "");
    }
  }

  // ---- header ----

  function renderHeader(data) {
    const p = data.proxy;
    const pill = $("#readiness");
    if (p.draining) {
      pill.className = "pill pill-warn";
      pill.textContent = "draining";
    } else if (p.ready) {
      pill.className = "pill pill-ok";
      pill.textContent = "ready";
    } else {
      pill.className = "pill pill-bad";
      pill.textContent = "not ready: " + p.reason;
    }
    setText(
      "#meta",
      p.kv_connector + " · v" + p.version + " · up " + uptime(p.uptime_seconds) + " · " +
        p.in_flight + " request" + (p.in_flight === 1 ? "" : "s") + " in flight" +
        (p.queue_depth ? ", " + p.queue_depth + " queued" : "") + workersText(p),
    );
  }

  // --workers: every figure is the whole proxy's; this says how it splits over the workers.
  function workersText(p) {
    if (!p.workers) return "";
    const each = p.workers.map((w) => "#" + (w.index + 1) + " " + w.in_flight);
    return " · " + p.workers.length + " workers (" + each.join(", ") + ")";
  }

  function setLive(ok, text) {
    const live = $("#live");
    live.className = "live " + (ok ? "ok" : "bad");
    setText("#live-text", text);
  }

  // ---- instances ----

  // [label, class]: the one word that says whether the instance takes traffic.
  function status(i) {
    if (i.state === "draining") return ["draining", "warn"];
    if (i.state === "pending") return ["pending", "info"];
    if (i.health === "unhealthy") return ["down", "bad"];
    if (i.breaker === "open") return ["ejected", "bad"];
    if (i.breaker === "half_open") return ["on trial", "warn"];
    if (i.health === "unknown") return ["probing", "info"];
    if (i.overloaded) return ["overloaded", "warn"];
    return ["up", "ok"];
  }

  function healthCell(i) {
    const cls = { healthy: "", unhealthy: "bad", unknown: "muted" }[i.health] || "";
    return el("td", { "data-field": "health" }, [el("span", { class: cls, text: i.health })]);
  }

  function breakerCell(i) {
    let text = i.breaker.replace("_", "-");
    let cls = "";
    if (i.breaker === "open") {
      cls = "bad";
      if (i.ejected_for_seconds !== null) text += " · " + fixed(i.ejected_for_seconds, 1) + " s left";
    } else if (i.breaker === "half_open") {
      cls = "warn";
    }
    const cell = el("td", { "data-field": "breaker" }, [el("span", { class: cls, text: text })]);
    const notes = [];
    if (i.consecutive_failures) notes.push(i.consecutive_failures + " failed");
    if (i.ejections) notes.push("ejected " + i.ejections + "×");
    if (notes.length) cell.append(el("span", { class: "muted", text: " · " + notes.join(", ") }));
    cell.title = cell.textContent + " (legs failed in a row, ejections so far)";
    return cell;
  }

  function loadCells(i) {
    const load = i.engine_load;
    if (!load) {
      const dash = () => el("td", { class: "n muted", text: "—", title: "no engine metrics yet" });
      return [dash(), dash(), el("td", { "data-field": "kv", class: "muted", text: "—" })];
    }
    const stale = !load.fresh;
    const title = "engine /metrics, " + fixed(load.age_s, 1) + " s ago" +
      (stale ? " (too old: the scheduler ignores it)" : "");
    const cls = stale ? "n stale" : "n";
    const pct = Math.max(0, Math.min(1, load.kv_usage));
    const fill = el("span");
    fill.style.width = (pct * 100).toFixed(1) + "%";
    const level = pct >= 0.9 ? " bad" : pct >= 0.7 ? " warn" : "";
    return [
      el("td", { class: cls, "data-field": "running", title: title, text: count(load.running) }),
      el("td", { class: cls, "data-field": "waiting", title: title, text: count(load.waiting) }),
      el("td", { "data-field": "kv", title: title, class: stale ? "stale" : "" }, [
        el("span", { class: "kv" }, [el("span", { class: "bar" + level }, [fill]), percent(pct)]),
      ]),
    ];
  }

  function ranksCell(i) {
    const ranks = (i.engine_load && i.engine_load.ranks) || [];
    const n = Math.max(i.dp_size, ranks.length, i.rank_in_flight.length);
    const cell = el("td", { "data-field": "dp" }, [el("span", { text: String(n) })]);
    if (n > 1) {
      const bars = el("span", { class: "ranks" });
      for (let r = 0; r < n; r++) {
        const figures = ranks.find((x) => x.rank === r);
        const legs = i.rank_in_flight[r] || 0;
        const fill = el("span");
        fill.style.height = ((figures ? figures.kv_usage : 0) * 100).toFixed(1) + "%";
        const title = figures
          ? "rank " + r + ": " + count(figures.running) + " running, " + count(figures.waiting) +
            " waiting, KV " + percent(figures.kv_usage) + ", " + legs + " in flight"
          : "rank " + r + ": " + legs + " in flight";
        bars.append(el("span", { class: "rank", title: title }, [fill]));
      }
      cell.append(bars);
    }
    return cell;
  }

  function row(i) {
    const [label, cls] = status(i);
    const where = el("td", { "data-field": "instance" }, [
      el("div", { class: "addr", text: i.address }),
    ]);
    if (i.models.length) where.append(el("div", { class: "models", text: i.models.join(", ") }));
    const tr = el("tr", { "data-url": i.url, "data-status": label }, [
      el("td", { "data-field": "status" }, [el("span", { class: "status st-" + cls, text: label })]),
      where,
      el("td", { "data-field": "source" }, [el("span", { class: "pill pill-muted", text: i.source })]),
      el("td", { "data-field": "state", text: i.state }),
      healthCell(i),
      breakerCell(i),
      el("td", { class: "n", "data-field": "in_flight", text: String(i.in_flight) }),
      ...loadCells(i),
      ranksCell(i),
    ]);
    if (cls === "bad" || i.state === "draining") tr.classList.add("dim");
    return tr;
  }

  function renderRole(role, instances) {
    const mine = instances.filter((i) => i.role === role);
    const body = $('[data-rows="' + role + '"]');
    if (mine.length === 0) {
      body.replaceChildren(el("tr", {}, [el("td", { class: "empty", colspan: "11", text: "no instance" })]));
    } else {
      body.replaceChildren(...mine.map(row));
    }
    const up = mine.filter((i) => status(i)[1] === "ok").length;
    const legs = mine.reduce((sum, i) => sum + i.in_flight, 0);
    setText(
      '[data-summary="' + role + '"]',
      mine.length + " instance" + (mine.length === 1 ? "" : "s") + " · " + up + " up · " +
        legs + " leg" + (legs === 1 ? "" : "s") + " in flight",
    );
  }

  // ---- polling ----

  // Each served model's pool: a request for it is paired among these only.
  function renderModels(models) {
    const names = Object.keys(models || {});
    const line = $("[data-models]");
    line.hidden = names.length < 2;
    line.textContent = "Models: " + names.map((m) =>
      m + " (" + models[m].prefill.length + " P · " + models[m].decode.length + " D)").join(", ");
  }

  function render(data) {
    renderHeader(data);
    renderKpis(data);
    renderModels(data.models);
    renderRole("prefill", data.instances);
    renderRole("decode", data.instances);
    if (window.pdproxyKvEvents) window.pdproxyKvEvents.render(data.kv_events);
    if (window.pdproxyFlow) window.pdproxyFlow.render(data.flow, data.proxy.worker);
  }

  function askForKey() {
    const form = $("#keyform");
    form.hidden = false;
    const pill = $("#readiness");
    pill.className = "pill pill-muted";
    pill.textContent = "locked";
    setLive(false, "needs an API key");
    $("#key").focus();
  }

  async function poll() {
    if (polling) return;
    polling = true;
    try {
      await pollOnce();
    } finally {
      polling = false;
    }
  }

  async function pollOnce() {
    const headers = { Accept: "application/json" };
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = "Bearer " + key;
    const abort = new AbortController();
    const guard = setTimeout(() => abort.abort(), 5000);
    try {
      const response = await fetch("dashboard/data", { headers, cache: "no-store", signal: abort.signal });
      if (response.status === 401) {
        sessionStorage.removeItem(KEY_STORE);
        askForKey();
        return; // polling resumes when a key is entered
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
      lastOk = Date.now();
      $("#keyform").hidden = true;
      setLive(true, "live · " + new Date(lastOk).toLocaleTimeString("en-GB"));
    } catch (err) {
      if (Date.now() - lastOk > STALE_AFTER_MS) {
        const since = lastOk ? " since " + new Date(lastOk).toLocaleTimeString("en-GB") : "";
        setLive(false, "no answer from pdproxy" + since + ", retrying");
      }
    } finally {
      clearTimeout(guard);
    }
    document.body.classList.toggle("offline", Date.now() - lastOk > STALE_AFTER_MS);
    schedule();
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("#keyform").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("#key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      $("#key").value = "";
      $("#keyform").hidden = true;
      poll();
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) poll();
    });
    poll();
  });
})();
