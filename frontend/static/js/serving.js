// Serving: model slots with live figures, workers, the standby pool, and
// anything FAILED or rolled back. Reads /status in either shape: per-model
// slots ("models": {...}) or the older single "serving" model.

import {h, table, badge, isObj, num, fmtBytes, fmtMs, fmtNum, fmtTime, fmtSecs, modelRef, renderInto} from "./ui.js";

const list = (v) => (Array.isArray(v) ? v : isObj(v) ? Object.values(v) : []);

export function workersOf(status) {
  const seen = new Map();
  for (const w of list(status.workers)) if (isObj(w)) seen.set(w.pid ?? w.generation ?? seen.size, w);
  for (const m of list(status.models)) for (const w of list(m && m.workers)) if (isObj(w) && !seen.has(w.pid ?? w.generation)) seen.set(w.pid ?? w.generation, w);
  return [...seen.values()];
}

export function slotsOf(status) {
  const workers = workersOf(status);
  const mine = (name) => workers.filter((w) => isObj(w.model) && w.model.name === name);
  if (isObj(status.models)) {
    return Object.entries(status.models).filter(([, m]) => isObj(m)).map(([key, m]) => {
      const name = typeof m.name === "string" ? m.name : key;
      return {...m, name, isDefault: status.default === name, workers: Array.isArray(m.workers) ? m.workers : mine(name)};
    });
  }
  if (isObj(status.serving) && status.serving.name !== undefined) {
    const s = status.serving;
    const ws = mine(s.name).filter((w) => w.state !== "DRAINING");
    return [{name: s.name, version: s.version, replicas: ws.length || 1, state: "SERVING", labels: s.labels, isDefault: true, workers: ws}];
  }
  return [];
}

export function poolOf(status) {
  if (Array.isArray(status.pool)) return status.pool.filter(isObj);
  return isObj(status.standby) ? [status.standby] : [];
}

// FAILED models and rolled-back versions, whatever field they arrive in
export function problemsOf(status) {
  const out = [];
  const add = (kind, o, name) => {
    if (!isObj(o)) return;
    out.push({kind, name: o.name ?? name, version: o.version ?? o.to_version ?? o.from_version,
              reason: o.reason ?? o.error ?? o.message ?? "", at: o.at ?? o.time ?? o.failed_at});
  };
  for (const f of list(status.failed_models)) add("FAILED", f);
  for (const f of list(status.rolled_back)) add("ROLLED BACK", f);
  if (isObj(status.models)) {
    for (const [name, m] of Object.entries(status.models)) {
      if (!isObj(m)) continue;
      if (isObj(m.failed) && !out.some((p) => p.name === (m.failed.name ?? name) && p.version === m.failed.version)) add("FAILED", m.failed, name);
      for (const r of [].concat(m.rolled_back || [], m.last_rollback || [])) add(isObj(r) && r.auto ? "ROLLED BACK (auto)" : "ROLLED BACK", r, name);
    }
  }
  return out;
}

export function servedByModel(status) {
  const out = {};
  for (const w of workersOf(status)) {
    if (isObj(w.model) && typeof w.model.name === "string" && num(w.served) !== null) out[w.model.name] = (out[w.model.name] || 0) + w.served;
  }
  return out;
}

// probation (previous version kept loaded) and shadow / canary candidates
function rolloutLine(s) {
  const parts = [];
  const p = s.probation;
  if (isObj(p)) {
    parts.push("probation: v" + (p.version ?? "?") + " kept loaded" + (num(p.remaining_s) !== null ? ", " + Math.ceil(p.remaining_s) + " s left" : ""));
  }
  const c = s.candidate;
  if (isObj(c)) {
    let t = String(c.mode ?? "candidate") + " v" + (c.version ?? "?");
    if (num(c.fraction) !== null) t += " (" + Math.round(c.fraction * 100) + "%)";
    if (num(c.agreement_rate) !== null) t += ", agrees " + (c.agreement_rate * 100).toFixed(1) + "%";
    parts.push(t);
  }
  return parts.length ? h("p", {class: "rollout muted"}, parts.join(" · ")) : null;
}

function workerModel(w) { return isObj(w.model) ? modelRef(w.model) : "—"; }

export function renderServing(root, status, live, actions, routes) {
  const slots = slotsOf(status);
  const figures = Object.fromEntries(slots.map((s) => {
    const f = live.figures(s.name);
    // figures the status may carry itself win over our estimates
    const rps = num(s.rps) ?? num(s.requests_per_s) ?? f.rps;
    const p50 = num(s.p50_ms) ?? (num(s.latency_s?.p50) !== null ? s.latency_s.p50 * 1000 : f.p50);
    const p99 = num(s.p99_ms) ?? (num(s.latency_s?.p99) !== null ? s.latency_s.p99 * 1000 : f.p99);
    return [s.name, {rps, p50, p99}];
  }));
  const slotKey = JSON.stringify([slots.map((s) => [s.name, s.version, s.replicas, s.state, s.isDefault, (s.workers || []).length, s.probation, s.candidate]), figures, routes.rollback, routes.unload, [...(routes.armed || [])]]);
  renderInto(root.querySelector("#slots"), slotKey, () => {
    if (!slots.length) return h("p", {class: "empty"}, "No model serves yet.");
    return slots.map((s) => h("div", {class: "slot card", "data-model": s.name},
      h("div", {class: "slot-head"},
        h("span", {class: "slot-name"}, s.name),
        h("span", {class: "slot-version"}, s.version !== undefined && s.version !== null ? "v" + s.version : "v?"),
        badge(s.state || "SERVING"),
        s.isDefault ? h("span", {class: "badge b-default"}, "default") : null),
      h("dl", {class: "figs"},
        h("div", {}, h("dt", {}, "replicas"), h("dd", {class: "replicas"}, fmtNum(num(s.replicas) ?? (s.workers || []).length))),
        h("div", {}, h("dt", {}, "req/s"), h("dd", {class: "rps"}, figures[s.name].rps === null ? "—" : figures[s.name].rps.toFixed(1))),
        h("div", {}, h("dt", {}, "p50"), h("dd", {class: "p50"}, fmtMs(figures[s.name].p50))),
        h("div", {}, h("dt", {}, "p99"), h("dd", {class: "p99"}, fmtMs(figures[s.name].p99)))),
      rolloutLine(s),
      h("div", {class: "actions"},
        routes.rollback !== false ? h("button", {class: "btn rollback", type: "button", onclick: () => actions.rollback(s.name)}, "Roll back") : null,
        routes.unload !== false ? h("button", {class: "btn warn unload", type: "button", onclick: () => actions.unload(s.name)},
          routes.armed && routes.armed.has(s.name) ? "Confirm unload" : "Unload") : null)));
  });

  const workers = workersOf(status);
  const wKey = JSON.stringify(workers.map((w) => [w.generation, w.pid, w.state, w.model, w.served, w.inflight, w.rss_bytes, w.uss_bytes]));
  renderInto(root.querySelector("#workers"), wKey, () => table(
    ["gen", "pid", "state", "model", "in flight", "served", "RSS", "private"],
    workers.map((w) => h("tr", {},
      h("td", {}, fmtNum(w.generation)), h("td", {}, fmtNum(w.pid)), h("td", {}, badge(w.state)),
      h("td", {}, workerModel(w)), h("td", {class: "r"}, fmtNum(w.inflight)), h("td", {class: "r"}, fmtNum(w.served)),
      h("td", {class: "r"}, fmtBytes(w.rss_bytes)), h("td", {class: "r"}, fmtBytes(w.uss_bytes ?? w.private_bytes)))),
    {empty: "no workers"}));

  const pool = poolOf(status);
  const budget = isObj(status.budget) ? status.budget : null;
  const pKey = JSON.stringify([pool.map((w) => [w.pid, w.state, w.model, w.rss_bytes, w.uss_bytes]), budget]);
  renderInto(root.querySelector("#pool"), pKey, () => [
    budget ? h("p", {class: "muted"}, "workers " + fmtNum(budget.workers) + (budget.max_workers ? " of at most " + budget.max_workers : " (no cap)")) : null,
    pool.length ? h("ul", {class: "pool"}, pool.map((w) => h("li", {},
      badge(w.state), " pid ", fmtNum(w.pid),
      isObj(w.model) || isObj(w.preloaded) ? " · preloaded " + modelRef(w.model || w.preloaded) : " · no model",
      " · ", fmtBytes(w.rss_bytes)))) : h("p", {class: "empty"}, "no standby worker"),
  ]);

  const problems = problemsOf(status);
  const exits = list(status.recent_exits).slice(-5);
  const fKey = JSON.stringify([problems, exits, status.restarts]);
  renderInto(root.querySelector("#failures"), fKey, () => [
    problems.length ? h("ul", {class: "problems"}, problems.map((p) => h("li", {class: "problem"},
      h("span", {class: "badge b-failed"}, p.kind), " ", h("strong", {}, p.name ?? "?"),
      p.version !== undefined && p.version !== null ? " v" + p.version : "", " — ", String(p.reason || "no reason given"),
      p.at ? h("span", {class: "muted"}, " (" + fmtTime(p.at) + ")") : null))) : h("p", {class: "empty ok"}, "Nothing failed or rolled back."),
    h("p", {class: "muted"}, "restarts: " + fmtNum(num(status.restarts) ?? 0) +
      (exits.length ? " · last exits: " + exits.map((e) => (isObj(e) ? "pid " + (e.pid ?? "?") + " code " + (e.exitcode ?? e.code ?? "?") : String(e))).join(", ") : "")),
  ]);

  const sup = isObj(status.supervisor) ? status.supervisor : {};
  root.querySelector("#sup").textContent = "supervisor pid " + (sup.pid ?? "?") + " · up " + fmtSecs(sup.uptime_s) + " · RSS " + fmtBytes(sup.rss_bytes);
}
