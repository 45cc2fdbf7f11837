// History: a timeline of applies, rollbacks, unloads, crashes and restarts
// with each apply's phase timings. From GET /history (the durable record)
// when the service has it; otherwise from what this tab saw change in
// /status, labelled as such.

import {h, isObj, num, fmtSecs, fmtTime, renderInto} from "./ui.js";

const PHASE_COLORS = {queued: "#adb5bd", spawn: "#74c0fc", load: "#1c7ed6", warmup: "#4dabf7", swap: "#2f9e44",
  drain: "#fab005", stop: "#e8590c", gate: "#ae3ec9", preload: "#0c8599"};
const color = (p, i) => PHASE_COLORS[p] || ["#c2255c", "#5c940d", "#868e96"][i % 3];

export function recordsOf(data) {
  const list = Array.isArray(data) ? data : isObj(data) ? (data.history ?? data.events ?? data.records ?? data.items) : null;
  return Array.isArray(list) ? list.filter(isObj) : [];
}

// What this tab noticed in /status: used only when GET /history is absent
export class LocalHistory {
  constructor() { this.events = []; this.seenApply = null; this.seenExits = new Set(); this.seenFailed = new Set(); this.primed = false; }

  observe(status) {
    const add = (e) => this.events.push({at: Date.now() / 1000, ...e});
    const applies = [];
    if (isObj(status.last_apply)) applies.push(status.last_apply);
    if (isObj(status.models)) for (const m of Object.values(status.models)) if (isObj(m?.last_apply)) applies.push(m.last_apply);
    for (const a of applies) {
      const sig = JSON.stringify(a);
      if (this.seenApply === null) this.seenApply = new Set();
      if (this.seenApply.has(sig)) continue;
      this.seenApply.add(sig);
      const cur = isObj(a.current) ? a.current : {};
      add({kind: a.kind ?? "apply", name: cur.name, from_version: isObj(a.previous) && a.previous.name === cur.name ? a.previous.version : null,
        to_version: cur.version, source: a.source, phases: a.phases_s ?? a.phases, reason: a.unchanged ? "already serving" : null});
    }
    for (const e of Array.isArray(status.recent_exits) ? status.recent_exits : []) {
      const sig = JSON.stringify(e);
      if (this.seenExits.has(sig)) continue;
      this.seenExits.add(sig);
      // code 0 is a worker stopped on purpose (after a swap, an unload)
      const code = isObj(e) ? e.exitcode ?? e.code : null;
      if (this.primed && isObj(e) && code !== 0 && code !== null && code !== undefined) add({kind: "crash", name: e.model?.name, to_version: e.model?.version, reason: "pid " + (e.pid ?? "?") + " exited with code " + (e.exitcode ?? e.code ?? "?")});
    }
    for (const f of Array.isArray(status.failed_models) ? status.failed_models : []) {
      const sig = JSON.stringify(f);
      if (this.seenFailed.has(sig)) continue;
      this.seenFailed.add(sig);
      if (this.primed && isObj(f)) add({kind: "failed", name: f.name, to_version: f.version, reason: f.reason});
    }
    this.primed = true;
    if (this.events.length > 200) this.events.splice(0, this.events.length - 200);
  }
}

function phasesBar(phases) {
  if (!isObj(phases)) return null;
  const parts = Object.entries(phases).filter(([, v]) => num(v) !== null && v >= 0);
  const total = parts.reduce((a, [, v]) => a + v, 0);
  if (!parts.length) return null;
  return h("div", {class: "phases"},
    h("div", {class: "pbar", title: "total " + fmtSecs(total)}, parts.map(([p, v], i) => h("span", {
      class: "pseg", title: p + " " + fmtSecs(v),
      style: {width: (total > 0 ? Math.max(0.5, (100 * v) / total) : 100 / parts.length).toFixed(2) + "%", background: color(p, i)}}))),
    h("div", {class: "plegend"}, parts.map(([p, v], i) => h("span", {class: "pl"}, h("i", {style: {background: color(p, i)}}), p + " " + fmtSecs(v)))));
}

function versions(r) {
  const f = r.from_version ?? r.previous?.version, t = r.to_version ?? r.version ?? r.current?.version;
  if (f !== undefined && f !== null && t !== undefined && t !== null) return "v" + f + " → v" + t;
  if (t !== undefined && t !== null) return "v" + t;
  if (f !== undefined && f !== null) return "v" + f;
  return "";
}

export function renderHistory(root, records, local, names, filter) {
  const key = JSON.stringify([records, local, filter, names]);
  renderInto(root.querySelector("#history"), key, () => {
    const rows = records.slice().sort((a, b) => (num(b.id) ?? 0) - (num(a.id) ?? 0) || String(b.at).localeCompare(String(a.at)));
    return [
      local ? h("p", {class: "muted"}, "GET /history is not available on this service: showing what this tab saw change since it opened.") : null,
      rows.length ? h("ol", {class: "timeline"}, rows.map((r) => h("li", {class: "ev ev-" + String(r.kind ?? "event").toLowerCase().replace(/[^a-z_]/g, "")},
        h("div", {class: "ev-head"},
          h("span", {class: "ev-time"}, fmtTime(r.at ?? r.time ?? r.created_at)),
          h("span", {class: "badge b-" + String(r.kind ?? "event").toLowerCase().replace(/[^a-z_]/g, "")}, String(r.kind ?? "event")),
          h("strong", {class: "ev-name"}, String(r.name ?? "")), " ", versions(r),
          r.source ? h("span", {class: "muted"}, " · " + String(r.source)) : null),
        r.reason ? h("div", {class: "ev-reason"}, String(r.reason)) : null,
        phasesBar(r.phases ?? r.phases_s)))) : h("p", {class: "empty"}, "Nothing has happened yet."),
    ];
  });
}
