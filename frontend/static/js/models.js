// Models: every model and version in the store with its metrics and chosen
// configuration, which version serves, apply buttons, and the confusion
// matrix of one version as a heat map. Version metadata is immutable once
// published, so each is fetched once and cached.

import {h, table, isObj, num, fmtNum, fmtTime, kv, renderInto} from "./ui.js";
import * as api from "./api.js";

const metas = new Map();   // "name/version" -> meta | {error}
const pending = new Set();
const queue = [];
let active = 0;
let onLoaded = () => {};
const SHOWN = 6;           // versions listed per model before "show all"
const expanded = new Set();
// how the Apply buttons of a serving model apply: a plain swap (the previous
// version stays loaded in probation), or beside it as a shadow or canary
const MODES = [["normal", "swap", null], ["shadow", "shadow", {mode: "shadow", fraction: 1.0}],
  ["canary10", "canary 10%", {mode: "canary", fraction: 0.1}], ["canary50", "canary 50%", {mode: "canary", fraction: 0.5}]];
const modes = new Map();   // model name -> MODES key

export function setOnLoaded(fn) { onLoaded = fn; }
// after a shadow or canary started, Apply swaps again (no second candidate by accident)
export function resetApplyMode(name) { modes.delete(name); }

function want(name, version) {
  if (typeof name !== "string" || !Number.isInteger(version)) return;
  const k = name + "/" + version;
  if (metas.has(k) || pending.has(k)) return;
  pending.add(k);
  queue.push([name, version]);
  pump();
}

function pump() {
  while (active < 2 && queue.length) {
    const [name, version] = queue.shift();
    active++;
    api.get("/models/" + encodeURIComponent(name) + "/" + version)
      .then((m) => metas.set(name + "/" + version, isObj(m) ? m : {}))
      .catch((e) => { if (e.status !== 401) metas.set(name + "/" + version, {error: e.message}); })
      .finally(() => { pending.delete(name + "/" + version); active--; onLoaded(); pump(); });
  }
}

export function reportOf(meta) {
  if (!isObj(meta)) return {};
  for (const k of ["report", "training_report", "selection", "search", "auto"]) if (isObj(meta[k])) return meta[k];
  return {};
}

function metricsOf(meta, v) {
  const m = isObj(meta?.metrics) ? meta.metrics : isObj(v?.metrics) ? v.metrics : {};
  const r = reportOf(meta);
  return {
    accuracy: num(m.accuracy) ?? num(r.accuracy),
    f1: num(m.macro_f1) ?? num(m.f1_macro) ?? num(r.macro_f1) ?? num(r.cv_macro_f1),
  };
}

function chosenOf(meta) {
  const r = reportOf(meta);
  const c = r.chosen ?? r.chosen_config ?? r.config ?? r.best ?? meta?.chosen;
  if (isObj(c) && typeof c.name === "string") {
    const micro = num(c.cv_micro_f1);  // multi-label
    const cv = micro ?? num(c.cv_macro_f1) ?? num(c.score);
    return c.name + (cv !== null ? " (CV " + (micro !== null ? "micro" : "macro") + "-F1 " + cv.toFixed(4) + ")" : "");
  }
  if (isObj(c)) return kv(isObj(c.params) ? {...c, ...c.params} : c) || "—";
  if (typeof c === "string") return c;
  const p = isObj(meta?.params) ? meta.params : null;
  if (!p) return "—";
  return kv(p, ["architecture", "ngrams", "output_mode", "epochs"].filter((k) => k in p)) || "—";
}

// -> {labels, rows: number[][]} or null
export function confusionOf(meta) {
  if (!isObj(meta)) return null;
  const r = reportOf(meta);
  const cm = r.confusion_matrix ?? r.out_of_fold?.confusion_matrix ?? r.confusion ?? meta.metrics?.confusion_matrix ?? meta.confusion_matrix;
  let labels = r.labels ?? meta.labels;
  let rows = null;
  if (Array.isArray(cm)) rows = cm;
  else if (isObj(cm)) {
    const m = cm.rows ?? cm.matrix;
    if (Array.isArray(m)) { rows = m; labels = cm.labels ?? labels; }
    else {
      labels = Object.keys(cm);
      rows = labels.map((t) => labels.map((p) => (isObj(cm[t]) ? num(cm[t][p]) ?? 0 : 0)));
    }
  }
  if (!Array.isArray(rows) || !rows.length || !rows.every((row) => Array.isArray(row) && row.length === rows.length)) return null;
  if (!Array.isArray(labels) || labels.length !== rows.length) labels = rows.map((_, i) => "#" + i);
  return {labels: labels.map(String), rows: rows.map((row) => row.map((x) => num(x) ?? 0))};
}

function heatmap(cm) {
  const n = cm.labels.length;
  const grid = h("div", {class: "heat", style: {"grid-template-columns": "minmax(3em, max-content) repeat(" + n + ", minmax(2.6em, 1fr))"}});
  grid.appendChild(h("div", {class: "hc corner"}, "true \\ pred"));
  for (const l of cm.labels) grid.appendChild(h("div", {class: "hc head", title: l}, l));
  cm.rows.forEach((row, i) => {
    const total = row.reduce((a, b) => a + b, 0) || 1;
    grid.appendChild(h("div", {class: "hc head rowhead", title: cm.labels[i]}, cm.labels[i]));
    row.forEach((count, j) => {
      const share = count / total;
      // diagonal cells blue, mistakes red; the shade is the share of the row
      const hue = i === j ? 212 : 2;
      grid.appendChild(h("div", {
        class: "hc cell" + (share > 0.55 ? " dark" : ""),
        title: cm.labels[i] + " → " + cm.labels[j] + ": " + count + " (" + (share * 100).toFixed(1) + "% of row)",
        style: {background: "hsla(" + hue + ", 75%, 45%, " + (0.06 + 0.9 * share).toFixed(3) + ")"},
      }, fmtNum(count, 0)));
    });
  });
  return h("div", {class: "heatwrap"}, grid);
}

function candidates(meta) {
  const r = reportOf(meta);
  const c = Array.isArray(r.candidates) ? r.candidates.filter(isObj) : [];
  if (!c.length) return null;
  return table(["candidate", "CV macro-F1", "± std", "time"], c.map((x) => {
    const label = typeof x.name === "string" ? x.name : kv(isObj(x.config) ? x.config : isObj(x.params) ? x.params : x, ["family", "architecture", "name"]);
    const score = num(x.cv_macro_f1) ?? num(x.macro_f1) ?? num(x.score) ?? num(x.mean);
    return h("tr", {}, h("td", {}, label || "?"), h("td", {class: "r"}, fmtNum(score, 4)),
      h("td", {class: "r"}, fmtNum(num(x.std) ?? num(x.cv_std), 4)), h("td", {class: "r"}, fmtNum(num(x.time_s) ?? num(x.seconds), 1) + " s"));
  }), {class: "compact"});
}

export function renderModels(root, listing, servingVersions, selected, actions) {
  const models = Array.isArray(listing?.models) ? listing.models.filter(isObj) : [];
  for (const m of models) {
    const versions = (Array.isArray(m.versions) ? m.versions : []).filter(isObj);
    for (const v of versions.slice(-SHOWN)) want(m.name, v.version);
  }
  if (selected) want(selected.name, selected.version);
  const metaKey = [...metas.keys()].join(",");
  const key = JSON.stringify([models.map((m) => [m.name, (m.versions || []).map((v) => v.version)]), servingVersions, metaKey, [...expanded], selected, [...modes]]);
  renderInto(root.querySelector("#models"), key, () => {
    if (!models.length) return h("p", {class: "empty"}, "The store holds no model yet.");
    return models.map((m) => {
      const versions = (Array.isArray(m.versions) ? m.versions : []).filter(isObj).slice().reverse();
      const shown = expanded.has(m.name) ? versions : versions.slice(0, SHOWN);
      const serving = servingVersions[m.name];
      const modeKey = Number.isInteger(serving) && modes.has(m.name) ? modes.get(m.name) : "normal";
      const [, modeLabel, rollout] = MODES.find(([k]) => k === modeKey);
      return h("div", {class: "model card", "data-model": m.name},
        h("div", {class: "model-head"}, h("span", {class: "model-name"}, m.name),
          serving === undefined ? h("span", {class: "badge b-idle"}, "not serving")
            : serving === null ? h("span", {class: "badge b-applying"}, "applying")
              : h("span", {class: "badge b-serving"}, "serves v" + serving),
          h("span", {class: "muted"}, versions.length + " version" + (versions.length === 1 ? "" : "s")),
          Number.isInteger(serving) ? h("label", {class: "apply-how"}, "apply as ",
            h("select", {class: "apply-mode", "aria-label": "how Apply applies " + m.name,
              onchange: (ev) => { modes.set(m.name, ev.target.value); actions.rerender(); }},
            MODES.map(([k, label]) => h("option", {value: k, selected: k === modeKey}, label)))) : null),
        table(["ver", "accuracy", "macro-F1", "chosen config", h("span", {class: "c-created"}, "created"), ""], shown.map((v) => {
          const meta = metas.get(m.name + "/" + v.version);
          const met = metricsOf(meta, v);
          const isServing = serving === v.version;
          const isSel = selected && selected.name === m.name && selected.version === v.version;
          return h("tr", {class: (isServing ? "serving" : "") + (isSel ? " selected" : ""), "data-version": v.version},
            h("td", {}, "v" + v.version, isServing ? h("span", {class: "dot", title: "serving"}, " ●") : null),
            h("td", {class: "r acc"}, meta ? fmtNum(met.accuracy, 4) : "…"),
            h("td", {class: "r f1"}, meta ? fmtNum(met.f1, 4) : "…"),
            h("td", {class: "cfg"}, meta ? (meta.error ? "error: " + meta.error : chosenOf(meta)) : "…"),
            h("td", {class: "nowrap c-created"}, meta ? fmtTime(meta.created_at) : "…"),
            h("td", {class: "nowrap"},
              h("button", {class: "btn small apply", type: "button", disabled: isServing, onclick: () => actions.apply(m.name, v.version, rollout)},
                isServing ? "serving" : rollout ? modeLabel[0].toUpperCase() + modeLabel.slice(1) : "Apply"),
              " ",
              h("button", {class: "btn small ghost matrix", type: "button", onclick: () => actions.select(m.name, v.version)}, "Matrix")));
        }), {class: "versions"}),
        versions.length > SHOWN ? h("button", {class: "btn small ghost", type: "button", onclick: () => { expanded.has(m.name) ? expanded.delete(m.name) : expanded.add(m.name); actions.rerender(); }},
          expanded.has(m.name) ? "show fewer" : "show all " + versions.length) : null);
    });
  });

  const meta = selected ? metas.get(selected.name + "/" + selected.version) : null;
  const cKey = JSON.stringify([selected, meta ? Object.keys(meta).length : 0]);
  renderInto(root.querySelector("#confusion"), cKey, () => {
    if (!selected) return h("p", {class: "empty"}, "Pick a version (Matrix) to see its confusion matrix.");
    const title = h("h3", {}, "Confusion matrix · ", h("span", {class: "sel-name"}, selected.name), " v" + selected.version);
    if (!meta) return [title, h("p", {class: "muted"}, "loading…")];
    const multi = meta.metrics?.multi_label === true;  // several labels per text: no confusion matrix
    const cm = multi ? null : confusionOf(meta);
    const r = reportOf(meta);
    const ece = num(r.ece_after) ?? num(r.ece) ?? num(r.calibration?.ece_after);
    const per = isObj(meta.metrics?.per_label) ? meta.metrics.per_label : isObj(r.out_of_fold?.per_label) ? r.out_of_fold.per_label : null;
    return [title,
      multi ? h("p", {class: "multi"}, "multi-label · micro-F1 " + fmtNum(meta.metrics.micro_f1, 4) + " · macro-F1 " +
          fmtNum(meta.metrics.macro_f1, 4) + " · samples-F1 " + fmtNum(meta.metrics.samples_f1, 4) + " (no confusion matrix: per-label counts below)")
        : cm ? heatmap(cm) : h("p", {class: "empty"}, "This version's report has no confusion matrix (added by automatic model selection)."),
      meta.metrics?.measured_on ? h("p", {class: "muted"}, "measured on " + String(meta.metrics.measured_on) + (ece !== null ? " · ECE " + fmtNum(ece, 4) : "")) : null,
      per ? table(["label", "precision", "recall", "F1", "support", ...(multi ? ["predicted", "threshold"] : [])], Object.entries(per).filter(([, x]) => isObj(x)).map(([label, x]) =>
        h("tr", {}, h("td", {}, label), h("td", {class: "r"}, fmtNum(x.precision, 3)), h("td", {class: "r"}, fmtNum(x.recall, 3)),
          h("td", {class: "r"}, fmtNum(x.f1, 3)), h("td", {class: "r"}, fmtNum(x.support, 0)),
          multi ? h("td", {class: "r"}, fmtNum(x.predicted, 0)) : null,
          multi ? h("td", {class: "r"}, fmtNum(meta.thresholds?.[label], 3)) : null)), {class: "compact"}) : null,
      candidates(meta)];
  });
}
