// The dashboard's loop: one tick a second at most (none while the tab is
// hidden), each tick one GET /status plus what changed: /metrics every other
// tick (not while it answers 404: metrics.enabled is false), /train/<id> for
// charted running jobs, /models and /history when the status says something
// changed (or every 15 s / 5 s). Actions (apply, roll back, promote, abort,
// unload, train, cancel) refresh at once.

import * as api from "./api.js";
import {h, isObj, toast} from "./ui.js";
import {LiveFigures} from "./metrics.js";
import {renderServing, slotsOf, servedByModel} from "./serving.js";
import {renderModels, setOnLoaded, resetApplyMode} from "./models.js";
import {renderJobs, renderCharts, setupForm, cancelJob, isActive} from "./training.js";
import {renderHistory, recordsOf} from "./history.js";
import {ReviewPanel} from "./review.js";
import {TryPanel} from "./tryit.js";
import {renderQuality, setOnQualityLoaded} from "./quality.js";

const TICK_MS = 1000;
const $ = (sel) => document.querySelector(sel);

const state = {
  status: null, listing: null, history: [], historyError: null,
  selectedModel: null, selectedJob: null, jobDetails: new Map(), tick: 0,
  modelsSig: null, historySig: null, paused: false, historyFilter: "",
  lastModelsTick: -99, lastHistoryTick: -99, metricsOffUntil: 0, armed: new Map(),
};
const live = new LiveFigures();
const review = new ReviewPanel($("#review"));
const tryit = new TryPanel($("#tryit"));

// -- token ---------------------------------------------------------------------------
api.onAuthNeeded((why) => {
  state.paused = true;
  const box = $("#auth");
  const msg = $("#auth-msg");
  msg.textContent = why === "wrong"
    ? "The service refused this key (401 Unauthorized). Check the key and enter it again."
    : "This service needs a key: the admin or review key from its key file (or open the dashboard URL it printed at start). It is kept in this tab only (sessionStorage).";
  msg.className = why === "wrong" ? "auth-msg error" : "auth-msg";
  api.setToken("");
  box.hidden = false;
  $("#conn").textContent = why === "wrong" ? "key refused" : "key needed";
  $("#conn").className = "conn bad";
  setTimeout(() => $("#auth-token").focus(), 0);
});

$("#auth-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const value = $("#auth-token").value;
  if (!value.trim()) return;
  api.setToken(value);
  $("#auth-token").value = "";
  $("#auth").hidden = true;
  state.paused = false;
  state.lastModelsTick = state.lastHistoryTick = -99;
  schedule(0);
});

$("#forget").addEventListener("click", async () => {
  await api.forget();
  toast("Key forgotten for this tab.");
  schedule(0);
});

// -- actions -------------------------------------------------------------------------
async function act(what, fn) {
  try {
    const res = await fn();
    refreshSoon();
    return res;
  } catch (e) {
    if (e.status !== 401) toast(what + " failed: " + e.message, "error");
    refreshSoon();
    return null;
  }
}

const secs = (x) => (typeof x === "number" ? " (" + (x < 0.1 ? (x * 1000).toFixed(1) + " ms" : x.toFixed(2) + " s") + ")" : "");

const actions = {
  // mode: "normal", or {mode: "shadow"|"canary", fraction}
  apply: async (name, version, rollout) => {
    const body = {name, version};
    if (rollout && rollout.mode !== "normal") Object.assign(body, rollout);
    const how = body.mode ? " as a " + body.mode + " candidate" : "";
    toast("Applying " + name + " v" + version + how + "…");
    const res = await act("Apply", () => api.post("/apply", body));
    if (res && body.mode) resetApplyMode(name);
    if (res && body.mode) toast(name + " v" + version + " runs as a " + body.mode + " beside v" + (res.serving?.version ?? "?") + secs(res.total_s) + ".", "ok");
    else if (res) toast(name + " v" + (res.current?.version ?? version) + " serves" + secs(res.total_s) + ".", "ok");
  },
  rollback: async (name) => {
    const res = await act("Roll back", () => api.post("/rollback", {name}));
    if (res) toast("Rolled back " + name + " v" + res.from_version + " → v" + res.to_version + (res.instant ? ", instantly" : "") + secs(res.took_s) + ".", "ok");
  },
  promote: async (name) => {
    const res = await act("Promote", () => api.post("/promote", {name}));
    if (res) toast(name + " v" + res.to_version + " promoted from " + res.mode + secs(res.swap_s) + ".", "ok");
  },
  abort: async (name) => {
    const res = await act("Abort", () => api.post("/abort", {name}));
    if (res) toast(name + " v" + res.aborted_version + " (" + res.mode + ") aborted.", "ok");
  },
  unload: async (name) => {
    // two clicks within 5 s: an unload stops serving that model
    if (!(state.armed.get(name) > performance.now())) {
      state.armed.set(name, performance.now() + 5000);
      setTimeout(() => { state.armed.delete(name); draw(); }, 5000);
      draw();
      return;
    }
    state.armed.delete(name);
    const res = await act("Unload", () => api.post("/unload", {name}));
    if (res) toast("Unloaded " + name + ".", "ok");
  },
  select: (name, version) => { state.selectedModel = {name, version}; draw(); },
  rerender: () => draw(),
};

const jobActions = {
  select: (id) => { state.selectedJob = id; draw(); },
  cancel: async (id) => { await cancelJob(id); refreshSoon(); },
};

setupForm($("#train-form"), (job) => {
  if (job.id) state.selectedJob = job.id;
  refreshSoon();
});

$("#hist-filter").addEventListener("change", (ev) => {
  state.historyFilter = ev.target.value;
  state.lastHistoryTick = -99;
  refreshSoon();
});

// -- polling -------------------------------------------------------------------------
let timer = null;
let running = false;
function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(loop, ms);
}
function refreshSoon() {
  state.lastModelsTick = state.lastHistoryTick = -99;
  if (!running) schedule(50);
}

// oldest first, whatever order the service lists them in
function jobsOf(status) {
  const jobs = Array.isArray(status?.jobs) ? status.jobs.filter(isObj) : [];
  const t = (j) => (typeof j.created_at === "number" ? j.created_at : Date.parse(j.created_at) / 1000 || 0);
  return jobs.slice().sort((a, b) => t(a) - t(b) || String(a.id).localeCompare(String(b.id)));
}

function chartedJobs(jobs) {
  const out = jobs.filter(isActive).slice(-4);
  const sel = state.selectedJob ? jobs.find((j) => j.id === state.selectedJob) : jobs[jobs.length - 1];
  if (sel && !out.includes(sel)) out.unshift(sel);
  return out;
}

async function loop() {
  if (state.paused) return;
  if (document.hidden) { schedule(TICK_MS); return; }
  running = true;
  const started = performance.now();
  const t = ++state.tick;
  try {
    const status = await api.get("/status");
    state.status = isObj(status) ? status : {};
    live.addStatus(servedByModel(state.status));
    if (t % 2 === 1 && t >= state.metricsOffUntil) {
      try {
        const text = await api.get("/metrics");
        if (typeof text === "string") live.addMetrics(text);
      } catch (e) {
        if (e.status === 401) throw e;
        if (e.status === 404) state.metricsOffUntil = t + 60;  // metrics are off: ask again in a minute
      }
    }
    const jobs = jobsOf(state.status);
    for (const job of chartedJobs(jobs)) {
      const have = state.jobDetails.get(job.id);
      // running: every tick; finished: once more for its final history
      if (isActive(job) || !have || (have.state !== job.state)) {
        try {
          const d = await api.get("/train/" + encodeURIComponent(job.id));
          if (isObj(d?.job)) state.jobDetails.set(job.id, d.job);
        } catch (e) { if (e.status === 401) throw e; }
      }
    }
    const slots = slotsOf(state.status);
    const modelsSig = JSON.stringify([slots.map((s) => [s.name, s.version]), jobs.map((j) => [j.id, j.state])]);
    if (modelsSig !== state.modelsSig || t - state.lastModelsTick >= 15) {
      const listing = await api.get("/models");
      state.listing = isObj(listing) ? listing : {};
      state.modelsSig = modelsSig;
      state.lastModelsTick = t;
    }
    const historySig = JSON.stringify([state.status.restarts, state.status.failed_models, slots.map((s) => [s.name, s.version, s.state,
      s.probation?.version, s.candidate?.version, (s.rolled_back || []).length, s.last_apply?.total_s])]);
    if (historySig !== state.historySig || t - state.lastHistoryTick >= 5) {
      const q = "/history?limit=50" + (state.historyFilter ? "&name=" + encodeURIComponent(state.historyFilter) : "");
      try {
        state.history = recordsOf(await api.get(q));
        state.historyError = null;
      } catch (e) {
        if (e.status === 401) throw e;
        state.historyError = e.message;
      }
      state.historySig = historySig;
      state.lastHistoryTick = t;
    }
    draw();
    $("#conn").textContent = "live · " + new Date().toLocaleTimeString();
    $("#conn").className = "conn ok";
  } catch (e) {
    if (e.status !== 401) {
      $("#conn").textContent = "offline: " + e.message;
      $("#conn").className = "conn bad";
    }
  } finally {
    running = false;
  }
  if (!state.paused) schedule(Math.max(0, TICK_MS - (performance.now() - started)));
}

// a failed durable write (disk full, I/O error): serving goes on, changes are refused
function renderStorage(el, st) {
  const bad = isObj(st) && st.ok === false;
  el.hidden = !bad;
  if (!bad) return;
  const e = isObj(st.last_error) ? st.last_error : {};
  const free = Number.isFinite(st.free_bytes) ? ` · ${(st.free_bytes / 1048576).toFixed(1)} MiB free` : "";
  el.textContent = `Storage: writing ${e.what ?? "?"} failed (${e.errno_name ?? ""} ${e.message ?? ""}) at ${e.path ?? "?"}${free}. ` +
    "Serving goes on; applies, rollbacks and other changes are refused until writes work again.";
}

function draw() {
  const status = state.status;
  if (!status) return;
  renderServing(document, status, live, actions, new Set(state.armed.keys()));
  renderStorage($("#storage-banner"), status.storage);
  const slots = slotsOf(status);
  const servingVersions = Object.fromEntries(slots.map((s) => [s.name, Number.isInteger(s.version) ? s.version : null]));
  const withVersion = slots.filter((s) => Number.isInteger(s.version));
  if (!state.selectedModel && withVersion.length) {
    const d = withVersion.find((s) => s.isDefault) || withVersion[0];
    state.selectedModel = {name: d.name, version: d.version};
  }
  renderModels(document, state.listing, servingVersions, state.selectedModel, actions);
  if (state.listing) { tryit.update(state.listing); review.update(state.listing); }
  renderQuality($("#quality"), slots.map((s) => s.name));
  const jobs = jobsOf(status);
  renderJobs($("#jobs"), jobs, state.selectedJob ?? jobs[jobs.length - 1]?.id, jobActions);
  renderCharts($("#charts"), chartedJobs(jobs), state.jobDetails);
  const names = (Array.isArray(state.listing?.models) ? state.listing.models : []).map((m) => m?.name).filter((n) => typeof n === "string");
  const sel = $("#hist-filter");
  if (sel.options.length - 1 !== names.length) {
    const cur = sel.value;
    sel.replaceChildren(h("option", {value: ""}, "all models"), ...names.map((n) => h("option", {value: n}, n)));
    sel.value = names.includes(cur) ? cur : "";
  }
  renderHistory(document, state.history, state.historyError, state.historyFilter);
}

setOnLoaded(() => draw());
setOnQualityLoaded(() => draw());
document.addEventListener("visibilitychange", () => { if (!document.hidden && !state.paused) schedule(0); });
window.addEventListener("resize", () => draw());
// for measuring what the page costs (requests per second while open)
window.textswapDashboard = {stats: api.stats, state};
api.exchangeStartCode().then(() => schedule(0));
