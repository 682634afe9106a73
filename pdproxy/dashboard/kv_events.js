// pdproxy fleet dashboard: the KV-events table (the engines' own prefix caches), from
// dashboard/data's kv_events (/status's). One row per engine rank whose events are
// followed: what its events built, what the self-check found, and a badge when the
// approximate index scores it instead (distrusted by the self-check, or stale).
// Every server string goes through textContent.
"use strict";

(function () {
  const el = window.PdproxyDom.el; // dom.js

  // [badge, class]: why the rank is, or is not, scored from its events
  function scoredBy(r) {
    const check = r.self_check || {};
    if (!r.followed) return ["not yet", "info"];
    if (check.distrusted) return ["distrusted", "bad"];
    if (r.stale) return ["stale", "warn"];
    return ["events", "ok"];
  }

  function num(field, value) {
    return el("td", { class: "n", "data-field": field, text: String(value) });
  }

  function row(name, r) {
    const [badge, cls] = scoredBy(r);
    const check = r.self_check || { checked: 0, wrong: 0, abs_error_tokens: 0 };
    const cut = name.lastIndexOf("|"); // an engine rank's name is "URL|rank"
    const address = name.slice(0, cut).replace(/^https?:[/][/]/, "");
    const where = el("td", { "data-field": "rank" }, [
      el("div", { class: "addr", text: address + " · rank " + name.slice(cut + 1) }),
      el("div", { class: "models", text: r.endpoint }),
    ]);
    return el("tr", { "data-rank": name, "data-badge": badge }, [
      el("td", { "data-field": "badge" }, [el("span", { class: "status st-" + cls, text: badge })]),
      where,
      el("td", { "data-field": "followed", text: r.followed ? "yes" : "no" }),
      num("indexed_blocks", r.indexed_blocks),
      num("checked", check.checked),
      num("wrong", check.wrong),
      num("error", check.abs_error_tokens),
      num("batches", r.batches),
    ]);
  }

  function render(kv) {
    const section = document.querySelector("[data-kv-events]");
    section.hidden = !kv;
    if (!kv) return;
    const names = Object.keys(kv.instances).sort();
    const body = document.querySelector("[data-kv-rows]");
    if (names.length === 0) {
      body.replaceChildren(el("tr", {}, [el("td", { class: "empty", colspan: "8", text: "no engine followed" })]));
    } else {
      body.replaceChildren(...names.map((n) => row(n, kv.instances[n])));
    }
    const off = names.filter((n) => scoredBy(kv.instances[n])[0] !== "events").length;
    document.querySelector('[data-summary="kv_events"]').textContent =
      kv.indexed_blocks + " of " + kv.max_blocks + " blocks indexed · " + names.length +
      " engine rank" + (names.length === 1 ? "" : "s") + " · " + off + " scored approximately";
  }

  window.pdproxyKvEvents = { render: render };
})();
