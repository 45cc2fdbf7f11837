// Training: the job list with state and progress, a live uPlot chart of each
// running job's per-epoch loss and validation figures (or candidate scores
// while automatic selection searches), the start form, cancel.

import {h, table, badge, isObj, num, fmtNum, fmtSecs, fmtTime, renderInto, toast} from "./ui.js";
import {examplesFrom, descriptionsFrom} from "./csv.js";
import * as api from "./api.js";

const ACTIVE = new Set(["queued", "running", "starting", "publishing", "applying"]);
export const isActive = (job) => ACTIVE.has(String(job?.state || "").toLowerCase());

// Figures that are not curves: counters, sizes, times
const SKIP = /^(epoch|epochs|candidate|candidates|index|i|n|step|steps|total|of)$|time|seconds|_s$|^n_|std|count|size|fold/;
const X_KEYS = ["epoch", "candidate", "index", "step"];
const COLORS = ["#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#0c8599", "#c2255c", "#5c940d", "#868e96"];

// history entries -> {xs, keys, loss keys, score keys}
export function seriesOf(history) {
  const rows = (Array.isArray(history) ? history : []).filter(isObj);
  const keys = [];
  for (const r of rows) for (const [k, v] of Object.entries(r)) if (num(v) !== null && !SKIP.test(k) && !keys.includes(k)) keys.push(k);
  const xs = rows.map((r, i) => { for (const k of X_KEYS) if (num(r[k]) !== null) return r[k]; return i + 1; });
  // uPlot needs increasing x: a refit after early stopping restarts epochs at 1
  const ordered = xs.every((x, i) => i === 0 || x > xs[i - 1]);
  return {
    xs: ordered ? xs : rows.map((_, i) => i + 1),
    xlabel: ordered && rows.some((r) => num(r.epoch) !== null) ? "epoch" : rows.some((r) => num(r.candidate) !== null) ? "candidate" : "step",
    keys,
    cols: keys.map((k) => rows.map((r) => num(r[k]))),
  };
}

const SHOW_JOBS = 25;      // newest jobs listed
const charts = new Map(); // job id -> {plot, sig, el}

function makeChart(el, s, width) {
  const lossy = (k) => /loss/.test(k);
  const hasLoss = s.keys.some(lossy), hasScore = s.keys.some((k) => !lossy(k));
  const series = [{label: s.xlabel}].concat(s.keys.map((k, i) => ({
    label: k, stroke: COLORS[i % COLORS.length], width: 2, scale: lossy(k) ? "loss" : "score",
    points: {show: true, size: 5}, value: (u, v) => (v === null || v === undefined ? "—" : v.toFixed(4)),
  })));
  const axes = [{label: s.xlabel, stroke: "#555", grid: {stroke: "#eee"}, incrs: [1, 2, 5, 10, 20, 50, 100]}];
  if (hasLoss) axes.push({scale: "loss", label: "loss", stroke: "#555", grid: {stroke: "#eee"}, size: 50});
  if (hasScore) axes.push({scale: "score", label: "score", side: 1, stroke: "#555", grid: {show: !hasLoss}, size: 50});
  const opts = {
    width, height: 220, series, axes,
    scales: {x: {time: false}, loss: {auto: true}, score: {auto: true}},
    legend: {live: true}, cursor: {drag: {x: false, y: false}},
  };
  return new uPlot(opts, [s.xs].concat(s.cols), el); // eslint-disable-line no-undef
}

export function renderCharts(container, jobs, details) {
  const want = new Set(jobs.map((j) => j.id));
  for (const [id, c] of charts) if (!want.has(id)) { c.plot?.destroy(); c.el.remove(); charts.delete(id); }
  if (!jobs.length) {
    if (!container.querySelector(".empty")) container.replaceChildren(h("p", {class: "empty"}, "No job to chart. Start one below; its loss and validation figures appear here per epoch."));
    return;
  }
  container.querySelector(".empty")?.remove();
  for (const job of jobs) {
    const full = details.get(job.id) || job;
    const s = seriesOf(full.history);
    const sig = JSON.stringify(s.keys);
    let c = charts.get(job.id);
    if (!c) {
      const plotEl = h("div", {class: "plot"});
      const el = h("div", {class: "chart card", "data-job": job.id},
        h("div", {class: "chart-head"}, h("span", {class: "job-name"}, String(job.name ?? "?")), " · job ", job.id, " ", badge(job.state), h("span", {class: "chart-points muted"}, "")),
        plotEl);
      container.appendChild(el);
      c = {el, plotEl, plot: null, sig: null};
      charts.set(job.id, c);
    }
    const head = c.el.querySelector(".chart-head");
    head.querySelector(".badge").replaceWith(badge(job.state));
    c.el.querySelector(".chart-points").textContent = " · " + s.xs.length + " point" + (s.xs.length === 1 ? "" : "s") + (num(full.progress?.epochs) ? " of at most " + full.progress.epochs : "");
    c.el.dataset.points = String(s.xs.length);
    if (!s.xs.length) {
      if (!c.plotEl.firstChild) c.plotEl.appendChild(h("p", {class: "muted waiting"}, "waiting for the first epoch…"));
      continue;
    }
    c.plotEl.querySelector(".waiting")?.remove();
    // the card's own width (the grid may put two charts side by side)
    const width = Math.max(240, Math.floor(c.el.clientWidth - 26));
    if (!c.plot || c.sig !== sig) {
      c.plot?.destroy();
      c.plot = makeChart(c.plotEl, s, width);
      c.sig = sig;
    } else {
      c.plot.setData([s.xs].concat(s.cols));
      if (Math.abs(c.plot.width - width) > 4) c.plot.setSize({width, height: 220});
    }
  }
}

function progressCell(job) {
  const p = isObj(job.progress) ? job.progress : {};
  const done = num(p.epoch) ?? num(p.candidate) ?? num(p.done), total = num(p.epochs) ?? num(p.of) ?? num(p.candidates) ?? num(p.total);
  const frac = isActive(job) ? (done !== null && total ? Math.min(1, done / total) : 0) : (job.state === "succeeded" ? 1 : null);
  const words = [isActive(job) ? p.phase : null, done !== null ? (num(p.epoch) !== null ? "epoch " : "candidate ") + done + (total ? "/" + total : "") : null,
    num(p.val_accuracy) !== null ? "val acc " + p.val_accuracy.toFixed(3) : null,
    num(p.best_score) !== null ? "best " + (typeof p.best === "string" ? p.best + " " : "") + p.best_score.toFixed(3) : null].filter(Boolean).join(" · ");
  return h("td", {class: "progress"},
    frac !== null ? h("div", {class: "bar"}, h("div", {class: "fill", style: {width: (frac * 100).toFixed(1) + "%"}})) : null,
    h("span", {class: "muted"}, words || "—"));
}

export function renderJobs(root, jobs, selectedId, actions) {
  const key = JSON.stringify([jobs.map((j) => [j.id, j.state, j.progress, j.result, j.error]), selectedId]);
  renderInto(root, key, () => table(["job", "model", "state", "progress", h("span", {class: "c-started"}, "started"), "time", ""],
    jobs.slice(-SHOW_JOBS).reverse().map((j) => h("tr", {class: j.id === selectedId ? "selected" : "", "data-job": j.id},
      h("td", {class: "mono"}, j.id), h("td", {}, String(j.name ?? "?"), isObj(j.result) ? " → v" + j.result.version : ""),
      h("td", {}, badge(j.state), j.error ? h("div", {class: "err"}, String(j.error).slice(0, 200)) : null),
      progressCell(j), h("td", {class: "nowrap c-started"}, fmtTime(j.started_at ?? j.created_at)), h("td", {class: "r"}, fmtSecs(j.elapsed_s)),
      h("td", {class: "nowrap"},
        h("button", {class: "btn small ghost chart-btn", type: "button", onclick: () => actions.select(j.id)}, "Chart"), " ",
        isActive(j) ? h("button", {class: "btn small warn cancel", type: "button", onclick: () => actions.cancel(j.id)}, "Cancel") : null))),
    {empty: "no training jobs"}));
}

export function setupForm(form, onStarted) {
  const sourceRadios = form.querySelectorAll("input[name=source]");
  const source = () => form.querySelector("input[name=source]:checked").value;
  const sync = () => {
    const src = source();
    form.querySelector(".src-path").hidden = src !== "path";
    form.querySelector(".src-csv").hidden = src !== "csv";
    // without data the descriptions are the whole model: a zero-shot version
    form.querySelector(".labels-need").textContent = src === "none"
      ? "required: each label's description is all the model knows of it"
      : "optional: with data, each is one more example of its label";
    form.querySelector("select[name=architecture]").disabled = src === "none";
    form.querySelector("input[name=epochs]").disabled = src === "none";
  };
  sourceRadios.forEach((r) => r.addEventListener("change", sync));
  sync();
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = form.elements;
    const msg = form.querySelector(".form-msg");
    msg.textContent = "";
    msg.className = "form-msg";
    try {
      const body = {name: f.name.value.trim(), params: {}};
      const src = source(), labels = descriptionsFrom(f.labels.value);
      if (src === "csv") body.data = {examples: examplesFrom(f.csv.value)};
      else if (src === "path") {
        if (!f.path.value.trim()) throw new Error("give a data path (a CSV or JSONL file under the service's data roots)");
        body.data = {path: f.path.value.trim()};
      } else if (!labels) throw new Error("give each label a description (one per line, 'label: description'): with no data they are the model");
      if (labels) body.labels = labels;
      if (src !== "none" && f.architecture.value) body.params.architecture = f.architecture.value;
      if (src !== "none" && f.epochs.value) body.params.epochs = Number(f.epochs.value);
      if (f.params.value.trim()) {
        let extra;
        try { extra = JSON.parse(f.params.value); } catch (e) { throw new Error("more params: not JSON (" + e.message + ")"); }
        if (!isObj(extra)) throw new Error("more params must be a JSON object, e.g. {\"ngrams\": 3}");
        Object.assign(body.params, extra);
      }
      if (f.apply.checked) body.apply = true;
      form.querySelector("button[type=submit]").disabled = true;
      const res = await api.post("/train", body);
      const job = isObj(res?.job) ? res.job : {};
      msg.textContent = "Started job " + (job.id ?? "?") + " (" + (job.state ?? "queued") + ").";
      msg.className = "form-msg ok";
      onStarted(job);
    } catch (e) {
      msg.textContent = (e.status ? e.status + ": " : "") + e.message;
      msg.className = "form-msg error";
      if (e.status !== 401) toast("Training not started: " + e.message, "error");
    } finally {
      form.querySelector("button[type=submit]").disabled = false;
    }
  });
}

export async function cancelJob(id) {
  try {
    const res = await api.del("/train/" + encodeURIComponent(id));
    toast("Job " + id + " " + (res?.job?.state ?? "cancelled") + ".");
  } catch (e) {
    toast("Cancel failed: " + e.message, "error");
  }
}
