// Live quality and drift: GET /models/<name>/quality for each serving model
// (every 5 s at most per model), one table per model: per version the
// predictions logged, the feedback, live accuracy (micro-F1 for a multi-label
// version) and macro-F1 beside the
// training-time figures, the drift signals against the version's training
// profile (over their threshold: red) and the alert.

import * as api from "./api.js";
import {h, table, isObj, num, fmtNum, renderInto} from "./ui.js";

const EVERY_MS = 5000;
const reports = new Map();   // name -> report | {error}
const asked = new Map();     // name -> performance.now() of the last request
let onLoaded = () => {};

export function setOnQualityLoaded(fn) { onLoaded = fn; }

function fetchSome(names) {
  const now = performance.now();
  for (const name of names) {
    if (now - (asked.get(name) ?? -1e9) < EVERY_MS) continue;
    asked.set(name, now);
    api.get("/models/" + encodeURIComponent(name) + "/quality")
      .then((r) => reports.set(name, isObj(r) ? r : {}))
      .catch((e) => { if (e.status !== 401) reports.set(name, {error: e.message}); })
      .finally(() => onLoaded());
  }
}

const pct = (v) => (num(v) === null ? "—" : (100 * v).toFixed(1) + "%");

function figure(live, training, key) {
  return h("span", {class: "q-fig"},
    h("b", {class: "q-live"}, pct(live?.[key])),
    h("span", {class: "muted"}, " · train " + pct(training?.[key])));
}

function signal(drift, key, limitKey) {
  const v = num(drift?.[key]);
  if (v === null) return h("span", {class: "muted"}, "—");
  const over = Array.isArray(drift.over) && drift.over.includes(key);
  const limit = num(drift.thresholds?.[limitKey]);
  return h("span", {class: over ? "q-over" : "q-ok", title: limit === null ? "" : "threshold " + limit},
    fmtNum(v, 3));
}

function driftCell(d) {
  if (d === null || d === undefined) return h("span", {class: "muted", title: "the version has no training profile"}, "no profile");
  const few = num(d.texts) !== null && num(d.min_texts) !== null && d.texts < d.min_texts;
  return d.alert ? h("span", {class: "badge q-alert"}, "DRIFT")
    : h("span", {class: "badge " + (few ? "q-few" : "q-quiet"), title: few ? "fewer texts than drift.min_texts" : ""},
      few ? "too few texts" : "ok");
}

function versionRow(v) {
  const d = isObj(v.drift) ? v.drift : null;
  return h("tr", {class: v.serving ? "q-serving" : "", "data-version": String(v.version)},
    h("td", {}, "v" + v.version, v.serving ? h("span", {class: "badge b-serving"}, "serving") : null),
    h("td", {class: "num"}, fmtNum(v.predictions, 0)),
    h("td", {class: "num"}, fmtNum(v.feedback, 0)),
    // a multi-label version: micro-F1 (accuracy there is the exact match of the set)
    v.live?.multi_label
      ? h("td", {class: "q-acc", title: "multi-label: micro-F1"}, h("span", {class: "muted"}, "micro-F1 "),
        figure({accuracy: v.live?.micro_f1}, {accuracy: v.training?.micro_f1}, "accuracy"))
      : h("td", {class: "q-acc"}, figure(v.live, v.training, "accuracy")),
    h("td", {}, figure({accuracy: v.live?.macro_f1}, {accuracy: v.training?.macro_f1}, "accuracy")),
    h("td", {class: "num"}, d ? fmtNum(d.texts, 0) : "—"),
    h("td", {class: "num q-unknown"}, d ? signal(d, "unknown_ngram_excess", "max_unknown_excess") : "—"),
    h("td", {class: "num"}, d ? signal(d, "label_js", "max_label_js") : "—"),
    h("td", {class: "num"}, d ? signal(d, "top_score_js", "max_top_score_js") : "—"),
    h("td", {class: "q-drift"}, driftCell(v.drift)));
}

const HEADERS = ["version", "predictions", "feedback", "live accuracy", "live macro-F1",
  "window", "unknown n-grams +", "label JS", "top-score JS", "drift"];

function modelCard(name, r) {
  if (!r) return h("div", {class: "card q-card"}, h("h3", {}, name), h("p", {class: "muted"}, "loading…"));
  if (r.error) return h("div", {class: "card q-card"}, h("h3", {}, name), h("p", {class: "error"}, r.error));
  const versions = Array.isArray(r.versions) ? r.versions.filter(isObj) : [];
  const alert = versions.some((v) => v.drift?.alert);
  return h("div", {class: "card q-card" + (alert ? " q-card-alert" : ""), "data-model": name},
    h("h3", {}, name, alert ? h("span", {class: "badge q-alert"}, "drift alert") : null),
    table(HEADERS, versions.map(versionRow), {class: "quality", empty: "no predictions logged yet"}));
}

export function renderQuality(el, names) {
  names = (names || []).filter((n) => typeof n === "string").sort();
  fetchSome(names);
  const key = JSON.stringify(names.map((n) => [n, reports.get(n)]));
  renderInto(el, key, () => names.length ? names.map((n) => modelCard(n, reports.get(n)))
    : h("p", {class: "muted"}, "no model serves"));
}
