// Serving: one card per model slot (GET /status "models") with live figures,
// its rollout state and the buttons that act on it: probation (the previous
// version kept loaded after a swap: "Roll back" is one routing assignment),
// a shadow or canary candidate (Promote, Abort), or a plain rollback that
// loads the previous version again. Then workers, the standby pool, and the
// versions rolled back or FAILED.
//
// A card's markup is rebuilt only when its structure changes (version,
// state, probation, candidate, buttons); the figures that move every second
// (req/s, latencies, time left, mirrored counts) are written into the
// existing elements, so buttons stay put under the pointer between polls.

import {h, table, badge, isObj, num, fmtBytes, fmtMs, fmtNum, fmtTime, fmtSecs, modelRef, renderInto} from "./ui.js";

const list = (v) => (Array.isArray(v) ? v : []);
const pct = (x, digits = 1) => (num(x) === null ? "—" : (x * 100).toFixed(digits) + "%");

export function workersOf(status) {
  return list(status.workers).filter(isObj);
}

export function slotsOf(status) {
  if (!isObj(status.models)) return [];
  return Object.entries(status.models).filter(([, m]) => isObj(m)).map(([key, m]) => ({
    ...m, name: typeof m.name === "string" ? m.name : key, isDefault: status.default === (m.name ?? key),
    workers: list(m.workers).filter(isObj)}));
}

export function poolOf(status) {
  return list(status.pool).filter(isObj);
}

// Versions rolled back (per slot) and FAILED ones, newest first
export function problemsOf(status) {
  const out = [];
  const seen = new Set();
  for (const s of slotsOf(status)) {
    for (const r of list(s.rolled_back).filter(isObj)) {
      out.push({kind: "rolled_back", name: s.name, version: r.version, back_to: r.back_to, auto: r.auto === true,
        reason: r.reason, figures: r.figures, at: r.at});
    }
    if (isObj(s.failed)) {
      seen.add(s.name + "/" + s.failed.version);
      out.push({kind: "failed", name: s.name, version: s.failed.version, reason: s.failed.reason, at: s.failed.at, slot: true});
    }
  }
  for (const f of list(status.failed_models).filter(isObj)) {
    if (seen.has(f.name + "/" + f.version)) continue;
    out.push({kind: "failed", name: f.name, version: f.version, reason: f.reason, at: f.at});
  }
  return out.sort((a, b) => (num(b.at) ?? 0) - (num(a.at) ?? 0));
}

export function servedByModel(status) {
  const out = {};
  for (const w of workersOf(status)) {
    if (isObj(w.model) && typeof w.model.name === "string" && num(w.served) !== null) out[w.model.name] = (out[w.model.name] || 0) + w.served;
  }
  return out;
}

// short figures of one version in one role (rollouts.VersionStats.describe())
function statsText(st) {
  if (!isObj(st)) return "—";
  return fmtNum(st.requests) + " req · " + fmtNum(st.errors) + " errors" + (num(st.requests) ? " (" + pct(st.error_rate) + ")" : "") +
    " · p50 " + fmtMs(st.p50_ms) + " · p99 " + fmtMs(st.p99_ms);
}

const field = (f, text) => h("span", {"data-f": f}, text ?? "");

function probationBox(s, p, actions) {
  return h("div", {class: "rollout probation", "data-version": p.version},
    h("div", {class: "ro-head"},
      h("span", {class: "badge b-probation"}, "probation"),
      h("span", {}, "v" + p.version + " kept loaded"),
      h("span", {class: "ro-left muted"}, field("remaining"))),
    h("div", {class: "ro-figs muted"}, "v" + (p.watching_version ?? s.version) + " since the swap: ", field("watch"),
      num(p.previous_p99_ms) !== null ? " · v" + p.version + " p99 was " + fmtMs(p.previous_p99_ms) : null),
    h("div", {class: "actions"},
      h("button", {class: "btn rollback", type: "button", title: "Route " + s.name + " back to v" + p.version + " (still loaded)",
        onclick: () => actions.rollback(s.name)}, "Roll back to v" + p.version),
      h("span", {class: "muted hint"}, "instant: one routing switch")));
}

function candidateBox(s, c, actions) {
  const shadow = c.mode === "shadow";
  const share = num(c.fraction) === null ? "" : Math.round(c.fraction * 1000) / 10 + "%";
  const examples = list(c.disagreements).filter(isObj).slice(0, 3);
  return h("div", {class: "rollout candidate", "data-mode": String(c.mode), "data-version": c.version},
    h("div", {class: "ro-head"},
      h("span", {class: "badge b-" + (shadow ? "shadow" : "canary")}, String(c.mode)),
      h("span", {}, "v" + c.version + " beside v" + (s.version ?? "?") + (shadow ? ": gets a copy of " + share + " of requests, answers dropped"
        : ": answers " + share + " of requests"))),
    shadow
      ? h("div", {class: "ro-figs muted"}, field("mirrored"), " requests mirrored, ", field("compared"), " texts compared · agreement ",
          h("strong", {"data-f": "agreement"}), " · mean score diff ", field("scorediff"), " · skipped (busy) ", field("skipped"))
      : h("div", {class: "ro-figs muted"}, "v" + c.version + ": ", field("cand"), h("br"), "v" + (s.version ?? "?") + ": ", field("serv")),
    examples.length ? h("div", {class: "tablewrap"}, h("table", {class: "compact disagree"},
      h("thead", {}, h("tr", {}, h("th", {}, "text"), h("th", {}, "v" + (s.version ?? "?")), h("th", {}, "v" + c.version))),
      h("tbody", {}, examples.map((e) => h("tr", {},
        h("td", {class: "dtext"}, String(e.text ?? "")),
        h("td", {}, String(e.serving?.label ?? "?")), h("td", {}, String(e.candidate?.label ?? "?"))))))) : null,
    h("div", {class: "actions"},
      h("button", {class: "btn promote", type: "button", title: "v" + c.version + " serves all requests (the quality gate runs first when a golden set exists)",
        onclick: () => actions.promote(s.name)}, "Promote v" + c.version),
      h("button", {class: "btn ghost abort", type: "button", onclick: () => actions.abort(s.name)}, "Abort")));
}

function slotCard(s, actions, armed) {
  const p = isObj(s.probation) ? s.probation : null;
  const c = isObj(s.candidate) ? s.candidate : null;
  const prev = Number.isInteger(s.previous_version) && s.previous_version !== s.version ? s.previous_version : null;
  return h("div", {class: "slot card", "data-model": s.name},
    h("div", {class: "slot-head"},
      h("span", {class: "slot-name"}, s.name),
      h("span", {class: "slot-version"}, Number.isInteger(s.version) ? "v" + s.version : "v?"),
      badge(s.state || "?"),
      s.isDefault ? h("span", {class: "badge b-default"}, "default") : null),
    h("dl", {class: "figs"},
      h("div", {}, h("dt", {}, "replicas"), h("dd", {class: "replicas"}, fmtNum(s.replicas) + (num(s.replicas_wanted) !== null && s.replicas_wanted !== s.replicas ? "/" + s.replicas_wanted : ""))),
      h("div", {}, h("dt", {}, "req/s"), h("dd", {class: "rps"}, "—")),
      h("div", {}, h("dt", {}, "p50"), h("dd", {class: "p50"}, "—")),
      h("div", {}, h("dt", {}, "p99"), h("dd", {class: "p99"}, "—"))),
    isObj(s.failed) ? h("p", {class: "slot-failed"}, h("span", {class: "badge b-failed"}, "FAILED"), " v" + (s.failed.version ?? "?") + ": " + String(s.failed.reason ?? "")) : null,
    p ? probationBox(s, p, actions) : null,
    c ? candidateBox(s, c, actions) : null,
    h("div", {class: "actions"},
      !p && prev !== null ? h("button", {class: "btn ghost rollback", type: "button", title: "v" + prev + " is no longer loaded: this loads it again",
        onclick: () => actions.rollback(s.name)}, "Roll back to v" + prev) : null,
      h("button", {class: "btn warn unload", type: "button", onclick: () => actions.unload(s.name)},
        armed.has(s.name) ? "Confirm unload" : "Unload")));
}

// the moving figures of one card, written in place
function fillCard(card, s, fig) {
  const set = (sel, text) => { const el = card.querySelector(sel); if (el && el.textContent !== text) el.textContent = text; };
  set("dd.rps", fig.rps === null ? "—" : fig.rps.toFixed(1));
  set("dd.p50", fmtMs(fig.p50));
  set("dd.p99", fmtMs(fig.p99));
  const p = s.probation, c = s.candidate;
  if (isObj(p)) {
    set('.probation [data-f="remaining"]', num(p.remaining_s) === null ? "" : (p.remaining_s < 120 ? Math.ceil(p.remaining_s) + " s" : fmtSecs(p.remaining_s)) + " left");
    set('.probation [data-f="watch"]', statsText(p.new_version));
  }
  if (isObj(c)) {
    set('.candidate [data-f="mirrored"]', fmtNum(c.mirrored));
    set('.candidate [data-f="compared"]', fmtNum(c.compared));
    set('.candidate [data-f="agreement"]', pct(c.agreement_rate));
    set('.candidate [data-f="scorediff"]', fmtNum(c.mean_score_diff, 4));
    set('.candidate [data-f="skipped"]', fmtNum(c.skipped_busy));
    set('.candidate [data-f="cand"]', statsText(c.candidate));
    set('.candidate [data-f="serv"]', statsText(c.serving));
  }
}

function problemItem(p) {
  const rolled = p.kind === "rolled_back";
  const st = isObj(p.figures) && isObj(p.figures.new_version) ? p.figures.new_version : null;
  return h("li", {class: "problem p-" + p.kind, "data-model": p.name, "data-version": p.version},
    rolled ? h("span", {class: "badge b-rollback"}, "rolled back") : h("span", {class: "badge b-failed"}, "FAILED"),
    rolled ? h("span", {class: "badge " + (p.auto ? "b-auto" : "b-manual")}, p.auto ? "auto" : "manual") : null,
    " ", h("strong", {}, String(p.name ?? "?")), " v" + (p.version ?? "?"),
    rolled && p.back_to !== undefined && p.back_to !== null ? " → back to v" + p.back_to : "",
    p.at ? h("span", {class: "muted"}, " · " + fmtTime(p.at)) : null,
    h("div", {class: "p-reason"}, String(p.reason || "no reason given")),
    st ? h("div", {class: "muted p-figs"}, "it answered " + statsText(st)) : null);
}

export function renderServing(root, status, live, actions, armed) {
  const slots = slotsOf(status);
  const slotKey = JSON.stringify([slots.map((s) => [s.name, s.version, s.state, s.replicas, s.replicas_wanted, s.isDefault, s.previous_version,
    s.failed, s.probation && [s.probation.version, s.probation.watching_version, s.probation.previous_p99_ms],
    s.candidate && [s.candidate.version, s.candidate.mode, s.candidate.fraction, list(s.candidate.disagreements).length]]), [...armed]]);
  const box = root.querySelector("#slots");
  renderInto(box, slotKey, () => (slots.length ? slots.map((s) => slotCard(s, actions, armed)) : h("p", {class: "empty"}, "No model serves yet.")));
  for (const s of slots) {
    const card = box.querySelector('.slot[data-model="' + CSS.escape(s.name) + '"]');
    if (!card) continue;
    const f = live.figures(s.name);
    fillCard(card, s, {rps: f.rps, p50: f.p50, p99: f.p99});
  }

  const workers = workersOf(status);
  const wKey = JSON.stringify(workers.map((w) => [w.generation, w.pid, w.state, w.model, w.served, w.inflight, w.rss_bytes, w.uss_bytes]));
  renderInto(root.querySelector("#workers"), wKey, () => table(
    ["gen", "pid", "state", "model", "in flight", "served", "RSS", "private"],
    workers.map((w) => h("tr", {},
      h("td", {}, fmtNum(w.generation)), h("td", {}, fmtNum(w.pid)), h("td", {}, badge(w.state)),
      h("td", {}, isObj(w.model) ? modelRef(w.model) : "—"), h("td", {class: "r"}, fmtNum(w.inflight)), h("td", {class: "r"}, fmtNum(w.served)),
      h("td", {class: "r"}, fmtBytes(w.rss_bytes)), h("td", {class: "r"}, fmtBytes(w.uss_bytes)))),
    {empty: "no workers"}));

  const pool = poolOf(status);
  const budget = isObj(status.budget) ? status.budget : null;
  const pKey = JSON.stringify([pool.map((w) => [w.pid, w.state, w.model, w.rss_bytes]), budget]);
  renderInto(root.querySelector("#pool"), pKey, () => [
    budget ? h("p", {class: "muted"}, "workers " + fmtNum(budget.workers) + (budget.max_workers ? " of at most " + budget.max_workers : " (no cap)")) : null,
    pool.length ? h("ul", {class: "pool"}, pool.map((w) => h("li", {},
      badge(w.state), " pid ", fmtNum(w.pid),
      isObj(w.model) ? " · preloaded " + modelRef(w.model) : " · no model",
      " · ", fmtBytes(w.rss_bytes)))) : h("p", {class: "empty"}, "no standby worker"),
  ]);

  const problems = problemsOf(status);
  const exits = list(status.recent_exits).slice(-5);
  const fKey = JSON.stringify([problems, exits, status.restarts]);
  renderInto(root.querySelector("#failures"), fKey, () => [
    problems.length ? h("ul", {class: "problems"}, problems.map(problemItem)) : h("p", {class: "empty ok"}, "Nothing failed or rolled back."),
    h("p", {class: "muted"}, "restarts: " + fmtNum(num(status.restarts) ?? 0) +
      (exits.length ? " · last exits: " + exits.map((e) => (isObj(e) ? "pid " + (e.pid ?? "?") + " code " + (e.exitcode ?? "?") : String(e))).join(", ") : "")),
  ]);

  const sup = isObj(status.supervisor) ? status.supervisor : {};
  root.querySelector("#sup").textContent = "supervisor pid " + (sup.pid ?? "?") + " · up " + fmtSecs(sup.uptime_s) + " · RSS " + fmtBytes(sup.rss_bytes);
}
