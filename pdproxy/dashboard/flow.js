// pdproxy fleet dashboard: the queue panel (flow control), from dashboard/data's flow
// (/status's flow section; null while flow control is off, and the panel hidden). Who
// waits at which stage, each tenant's share, admissions, refusals and deadlines met, and
// how far the TTFT prediction was from what happened. Tenant names come from the tenants
// file and request headers: every server string goes through textContent, never HTML.
"use strict";

(function () {
  const MAX_ROWS = 100; // per table; the JSON has them all

  const el = window.PdproxyDom.el; // dom.js

  function count(n) {
    return typeof n === "number" && Number.isFinite(n) ? n.toLocaleString("en-US") : "—";
  }

  function num(field, value, format) {
    return el("td", { class: "n", "data-field": field, text: (format || count)(value) });
  }

  function tenantCell(name) {
    return el("td", { class: "tenant", "data-field": "tenant", title: name, text: name });
  }

  // "rate_limit 3, deadline 1" (largest first), or "0" when nothing was refused
  function refusedText(refused) {
    const reasons = Object.entries(refused || {})
      .filter(([, n]) => n > 0)
      .sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
    return reasons.length ? reasons.map(([why, n]) => why + " " + count(n)).join(", ") : "0";
  }

  // "97.5 % of 40" once a request with a deadline ended, "—" before; rounded down to
  // 0.1 %, so one miss in many never shows as 100 %
  function sloText(met, missed) {
    const total = met + missed;
    if (!total) return "—";
    return Math.floor((met * 1000) / total) / 10 + " % of " + count(total);
  }

  function more(body, shown, total, columns) {
    if (total > shown) {
      const text = (total - shown).toLocaleString("en-US") + " more in dashboard/data";
      body.append(el("tr", {}, [el("td", { class: "empty", colspan: String(columns), text })]));
    }
  }

  function waitingRow(w) {
    return el("tr", { "data-stage": w.stage, "data-tenant": w.tenant }, [
      el("td", { "data-field": "stage", text: w.stage }),
      num("priority", w.priority, String),
      tenantCell(w.tenant),
      num("waiting", w.waiting),
    ]);
  }

  function tenantRow(name, t) {
    const met = t.slo_met || 0;
    const missed = t.slo_missed || 0;
    const refused = refusedText(t.refused);
    return el("tr", { "data-tenant": name }, [
      tenantCell(name),
      num("weight", t.weight),
      num("priority", t.priority, String),
      num("in_flight", t.in_flight),
      num("admitted", t.admitted),
      el("td", { "data-field": "refused", class: refused === "0" ? "muted" : "warn", text: refused }),
      el("td", {
        class: "n",
        "data-field": "slo",
        title: met + " met, " + missed + " missed (requests with x-slo-ttft-ms)",
        text: sloText(met, missed),
      }),
    ]);
  }

  function predictionText(p) {
    if (!p || p.median_error_ms === null || p.median_error_ms === undefined) {
      return "TTFT prediction: none checked yet (requests with x-slo-ttft-ms are predicted)";
    }
    return "TTFT prediction: median error " + count(p.median_error_ms) + " ms · " +
      count(p.samples) + " prediction" + (p.samples === 1 ? "" : "s") + " checked";
  }

  // flow: dashboard/data's flow (null: off); worker: dashboard/data's proxy.worker, if any
  function render(flow, worker) {
    const section = document.querySelector("[data-flow]");
    section.hidden = !flow;
    if (!flow) return;

    const waiting = flow.waiting || [];
    const wbody = document.querySelector("[data-flow-waiting]");
    if (waiting.length === 0) {
      wbody.replaceChildren(el("tr", {}, [el("td", { class: "empty", colspan: "4", text: "nobody waits" })]));
    } else {
      wbody.replaceChildren(...waiting.slice(0, MAX_ROWS).map(waitingRow));
      more(wbody, MAX_ROWS, waiting.length, 4);
    }

    const tenants = Object.entries(flow.tenants || {}).sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
    const tbody = document.querySelector("[data-flow-tenants]");
    if (tenants.length === 0) {
      tbody.replaceChildren(el("tr", {}, [el("td", { class: "empty", colspan: "7", text: "no tenant yet" })]));
    } else {
      tbody.replaceChildren(...tenants.slice(0, MAX_ROWS).map(([name, t]) => tenantRow(name, t)));
      more(tbody, MAX_ROWS, tenants.length, 7);
    }

    const parts = [count(flow.queued) + " waiting", tenants.length + " tenant" + (tenants.length === 1 ? "" : "s")];
    parts.push(flow.tenants_file ? "tenants file " + flow.tenants_file : "no tenants file");
    if (worker) parts.push("worker #" + (worker.index + 1) + " of " + worker.workers + " only");
    const summary = document.querySelector('[data-summary="flow"]');
    summary.textContent = parts.join(" · ");
    document.querySelector("[data-flow-prediction]").textContent = predictionText(flow.prediction);
  }

  window.pdproxyFlow = { render: render };
})();
