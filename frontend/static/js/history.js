// History: the durable timeline from GET /history, newest first. Each record
// is {id, at, name, kind, source, from_version, to_version, phases, reason,
// details}; kind is one of apply, apply_failed, rollback, promote, abort,
// gate_refused, unload, crash, restart, recycle, failed, shadow, canary,
// probation_ended, the retrain policy's retrain/retrain_done/retrain_failed,
// and the API's train, cancel, golden(_deleted), policy(_deleted), erase
// (details.key: the key that made the call). An apply shows its phase
// timings as a bar.

import {h, isObj, num, fmtNum, fmtSecs, fmtMs, fmtTime, renderInto} from "./ui.js";

const PHASE_COLORS = {queued: "#adb5bd", spawn: "#74c0fc", gate: "#ae3ec9", swap: "#2f9e44", drain_stop: "#fab005"};
const color = (p, i) => PHASE_COLORS[p] || ["#c2255c", "#5c940d", "#868e96", "#0c8599"][i % 4];
const cls = (s) => String(s ?? "event").toLowerCase().replace(/[^a-z_]/g, "");
const v = (x) => (x === undefined || x === null ? "v?" : "v" + x);
const pct = (x) => (num(x) === null ? "—" : (x * 100).toFixed(1) + "%");

export function recordsOf(data) {
  return isObj(data) && Array.isArray(data.history) ? data.history.filter(isObj) : [];
}

// apply answers also carry the old single-worker names (drain = drain_stop,
// stop and load = 0) for older clients: not phases of their own
function phasesOf(phases) {
  if (!isObj(phases)) return [];
  let parts = Object.entries(phases).filter(([, x]) => num(x) !== null && x >= 0);
  if ("drain_stop" in phases) parts = parts.filter(([p]) => !["drain", "stop", "load"].includes(p));
  return parts;
}

function phasesBar(phases) {
  const parts = phasesOf(phases);
  if (!parts.length) return null;
  const total = parts.reduce((a, [, x]) => a + x, 0);
  return h("div", {class: "phases"},
    h("div", {class: "pbar", title: "total " + fmtSecs(total)}, parts.map(([p, x], i) => h("span", {
      class: "pseg", title: p + " " + fmtSecs(x),
      style: {width: (total > 0 ? Math.max(0.5, (100 * x) / total) : 100 / parts.length).toFixed(2) + "%", background: color(p, i)}}))),
    h("div", {class: "plegend"}, parts.map(([p, x], i) => h("span", {class: "pl"}, h("i", {style: {background: color(p, i)}}), p.replace("_", "+") + " " + fmtSecs(x))),
      h("span", {class: "pl ptotal"}, "total " + fmtSecs(total))));
}

// what moved, in words: "v1 → v2", "v2 beside v1"...
function versions(r) {
  const f = r.from_version, t = r.to_version;
  switch (r.kind) {
    case "apply": case "rollback": case "promote":
      return f !== null && f !== undefined && f !== t ? v(f) + " → " + v(t) : v(t);
    case "shadow": case "canary": return v(t) + " beside " + v(f);
    case "abort": return "candidate " + v(t) + " dropped" + (f !== null && f !== undefined ? ", " + v(f) + " serves on" : "");
    case "gate_refused": return v(t) + " refused" + (f !== null && f !== undefined ? ", " + v(f) + " serves on" : "");
    case "probation_ended": return v(f) + " unloaded, " + v(t) + " kept";
    default: return t !== null && t !== undefined ? v(t) : f !== null && f !== undefined ? v(f) : "";
  }
}

function gateText(g) {
  if (!isObj(g)) return null;
  if (g.skipped) return "quality gate skipped on request";
  const c = isObj(g.candidate) ? g.candidate : {}, s = isObj(g.serving) ? g.serving : null;
  return "quality gate " + (g.passed === false ? "refused" : "passed") + ": accuracy " + fmtNum(c.accuracy, 4) +
    (s ? " vs " + fmtNum(s.accuracy, 4) + " for " + v(s.version) : "") + " on " + fmtNum(g.golden_examples) + " golden examples";
}

function statsText(st) {
  if (!isObj(st)) return null;
  return fmtNum(st.requests) + " req, " + fmtNum(st.errors) + " errors, p99 " + fmtMs(st.p99_ms);
}

// the details worth a line, per kind
function detailText(r) {
  const d = isObj(r.details) ? r.details : {};
  const out = [];
  switch (r.kind) {
    case "apply":
      if (d.from_probation) out.push("instant: the version was still loaded");
      if (num(d.replicas) !== null && d.replicas !== 1) out.push(d.replicas + " replicas");
      out.push(gateText(d.gate));
      break;
    case "gate_refused": out.push(gateText(d.gate)); break;
    case "shadow": case "canary": if (num(d.fraction) !== null) out.push(pct(d.fraction) + " of requests"); break;
    case "promote": case "abort":
      if (r.kind === "promote" && d.mode) out.push("from " + d.mode);
      if (num(d.agreement_rate) !== null) out.push("agreement " + pct(d.agreement_rate) + " over " + fmtNum(d.compared) + " compared");
      if (isObj(d.candidate) && num(d.candidate.requests)) out.push("candidate " + statsText(d.candidate));
      if (r.kind === "promote") out.push(gateText(d.gate));
      break;
    case "rollback":
      if (isObj(d.new_version)) out.push(v(r.from_version) + " had answered " + statsText(d.new_version));
      if (num(d.exitcode) !== null) out.push("exit code " + d.exitcode);
      break;
    case "probation_ended": if (num(d.requests) !== null) out.push(v(r.to_version) + " answered " + statsText(d)); break;
    case "train":
      out.push("job " + d.job + (d.architecture ? " · " + d.architecture : "") + (d.apply ? " · applies when trained" : ""));
      break;
    case "cancel": out.push("job " + d.job); break;
    case "golden":
      out.push(fmtNum(d.examples) + " golden examples" + (num(d.min_accuracy) !== null ? " · floor " + pct(d.min_accuracy) : ""));
      break;
    case "policy":
      if (isObj(d.policy)) out.push((d.policy.retrain_after_labels ? "retrain after " + fmtNum(d.policy.retrain_after_labels) + " labels" : "no retraining") + (d.policy.apply ? " · apply: " + d.policy.apply : ""));
      break;
    case "retrain_failed":
      if (d.code === "data_gone") out.push("the retrain policy waits: put the data file back, or train once with data");
      break;
    case "crash": case "restart": case "recycle":
      if (num(d.pid) !== null) out.push("pid " + d.pid);
      if (num(d.exitcode) !== null) out.push("exit code " + d.exitcode);
      break;
    default: break;
  }
  return out.filter(Boolean).join(" · ");
}

export function renderHistory(root, records, error, filter) {
  const key = JSON.stringify([records, error, filter]);
  renderInto(root.querySelector("#history"), key, () => {
    const rows = records.slice().sort((a, b) => (num(b.id) ?? 0) - (num(a.id) ?? 0) || (num(b.at) ?? 0) - (num(a.at) ?? 0));
    return [
      error ? h("p", {class: "error"}, "History unavailable: " + error) : null,
      rows.length ? h("ol", {class: "timeline"}, rows.map((r) => {
        const detail = detailText(r);
        return h("li", {class: "ev ev-" + cls(r.kind), "data-kind": cls(r.kind)},
          h("div", {class: "ev-head"},
            h("span", {class: "ev-time"}, fmtTime(r.at)),
            h("span", {class: "badge b-" + cls(r.kind)}, String(r.kind ?? "event").replace("_", " ")),
            h("strong", {class: "ev-name"}, String(r.name ?? "")),
            h("span", {class: "ev-versions"}, versions(r)),
            r.source ? h("span", {class: "ev-source muted"}, String(r.source) +
              (isObj(r.details) && r.details.key ? " · " + String(r.details.key) : "")) : null),
          r.reason ? h("div", {class: "ev-reason"}, String(r.reason)) : null,
          detail ? h("div", {class: "ev-detail muted"}, detail) : null,
          phasesBar(r.phases));
      })) : error ? null : h("p", {class: "empty"}, filter ? "Nothing has happened to " + filter + " yet." : "Nothing has happened yet."),
    ];
  });
}
