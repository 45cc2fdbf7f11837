// The dashboard's loop: one tick a second at most (none while the tab is
// hidden), each tick one GET /status plus what changed: /metrics every other
// tick, /train/<id> for charted running jobs, /models and /history when the
// status says something changed (or every 15 s / 10 s). Actions (apply, roll
// back, unload, train, cancel) refresh at once.

import * as api from "./api.js";
import {h, isObj, toast} from "./ui.js";
import {LiveFigures} from "./metrics.js";
import {renderServing, slotsOf, servedByModel} from "./serving.js";
import {renderModels, setOnLoaded} from "./models.js";
import {renderJobs, renderCharts, setupForm, cancelJob, isActive} from "./training.js";
import {renderHistory, recordsOf, LocalHistory} from "./history.js";

const TICK_MS = 1000;
const $ = (sel) => document.querySelector(sel);

const state = {
  status: null, listing: null, history: null, historyRoute: null, routes: {},
  selectedModel: null, selectedJob: null, jobDetails: new Map(), tick: 0,
  modelsSig: null, historySig: null, paused: false, historyFilter: "",
  lastModelsTick: -99, lastHistoryTick: -99, routesTick: -99, armed: new Map(),
};
const live = new LiveFigures();
const local = new LocalHistory();

// -- token ---------------------------------------------------------------------------
api.onAuthNeeded((why) => {
  state.paused = true;
  const box = $("#auth");
  const msg = $("#auth-msg");
  msg.textContent = why === "wrong"
    ? "The service refused this token (401 Unauthorized). Check the management token and enter it again."
    : "This service needs its management token. It is kept in this tab only (sessionStorage).";
  msg.className = why === "wrong" ? "auth-msg error" : "auth-msg";
  api.setToken("");
  box.hidden = false;
  $("#conn").textContent = why === "wrong" ? "token refused" : "token needed";
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

$("#forget").addEventListener("click", () => {
  api.setToken("");
  toast("Token forgotten for this tab.");
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

const actions = {
  apply: async (name, version) => {
    toast("Applying " + name + " v" + version + "…");
    const res = await act("Apply", () => api.post("/apply", {name, version}));
    if (res) toast(name + " v" + (res.current?.version ?? version) + " serves" + (typeof res.total_s === "number" ? " (" + res.total_s.toFixed(2) + " s)" : "") + ".", "ok");
  },
  rollback: async (name) => {
    const res = await act("Roll back", () => api.post("/rollback", {name}));
    const to = res ? res.to_version ?? res.current?.version : null;
    if (res) toast("Rolled back " + name + (to !== null && to !== undefined ? " to v" + to : "") + ".", "ok");
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
    local.observe(state.status);
    if (t === 1 || t - state.routesTick >= 60) await checkRoutes(t);
    if (t % 2 === 1 && state.routes.metrics !== false && !api.routeMissing("/metrics")) {
      try {
        const text = await api.get("/metrics");
        if (typeof text === "string") live.addMetrics(text);
      } catch (e) { if (e.status === 401) throw e; }
    }
    if (!Array.isArray(state.status.jobs) && t % 2 === 1) {
      const j = await api.optional("/train");
      if (isObj(j) && Array.isArray(j.jobs)) state.status.jobs = j.jobs;
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
    const historySig = JSON.stringify([state.status.last_apply, state.status.restarts, state.status.failed_models, slots.map((s) => [s.name, s.version, s.state])]);
    if (historySig !== state.historySig || t - state.lastHistoryTick >= 10) {
      const q = "/history?limit=50" + (state.historyFilter ? "&name=" + encodeURIComponent(state.historyFilter) : "");
      const data = state.routes.history === false ? null : await api.optional(q);
      state.historyRoute = data !== null;
      state.history = data === null ? null : recordsOf(data);
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

async function checkRoutes(t) {
  // Which optional routes this service has: those its OpenAPI document lists,
  // and those a probe (once a minute) finds although the document does not
  // list them yet. Absent ones are not polled; the page shows what it can.
  state.routesTick = t;
  let spec = null;
  try { spec = await api.optional("/openapi.json"); } catch (e) { if (e.status === 401) throw e; }
  const paths = isObj(spec?.paths) ? spec.paths : {};
  const routes = {};
  for (const [name, probe] of [["metrics", "/metrics"], ["history", "/history?limit=1"]]) {
    if ("/" + name in paths) { routes[name] = true; continue; }
    try { routes[name] = (await api.optional(probe)) !== null; } catch (e) { if (e.status === 401) throw e; routes[name] = false; }
  }
  state.routes = routes;
}

function draw() {
  const status = state.status;
  if (!status) return;
  // buttons show even when the spec does not list their route (it may lag
  // behind the handlers); a click on a missing one says so
  renderServing(document, status, live, actions, {armed: new Set(state.armed.keys())});
  const slots = slotsOf(status);
  const servingVersions = Object.fromEntries(slots.map((s) => [s.name, Number.isInteger(s.version) ? s.version : null]));
  const withVersion = slots.filter((s) => Number.isInteger(s.version));
  if (!state.selectedModel && withVersion.length) {
    const d = withVersion.find((s) => s.isDefault) || withVersion[0];
    state.selectedModel = {name: d.name, version: d.version};
  }
  renderModels(document, state.listing, servingVersions, state.selectedModel, actions);
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
  const records = state.historyRoute ? state.history || [] : local.events.filter((e) => !state.historyFilter || e.name === state.historyFilter);
  renderHistory(document, records, !state.historyRoute, names, state.historyFilter);
}

setOnLoaded(() => draw());
document.addEventListener("visibilitychange", () => { if (!document.hidden && !state.paused) schedule(0); });
window.addEventListener("resize", () => draw());
// for measuring what the page costs (requests per second while open)
window.textswapDashboard = {stats: api.stats, state};
schedule(0);
