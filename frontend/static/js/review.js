// Review: the queue of logged predictions that have no true label yet
// (GET /models/<name>/review, least sure first), one click or one key to
// confirm the predicted label or pick another, which posts POST /feedback
// on the management port (frontend/dashboard_routes.py: the inference
// port's own feedback handler behind the management token). A labelled
// item leaves the queue; the queue refills when it runs low.
//
// Keys, while an item of the queue has the focus (click it, or Tab to it):
//   Enter or y    confirm the predicted label
//   1-9           pick the label with that number
//   j / ↓, k / ↑  next / previous item
//   s             skip (leave it for later; it stays in the queue)
//   n             type a label the model does not know yet
//
// A multi-label model's items carry the label set it answered (`labels`):
// the label buttons then toggle labels in or out of the set, and Enter (or
// the send button) posts the set as it stands; 1-9 toggle.

import * as api from "./api.js";
import {h, isObj, num, toast} from "./ui.js";

const LIMIT = 50;
const REFILL_BELOW = 5;      // reload the queue when fewer items are left
const EMPTY_RECHECK_MS = 15000;

const enc = encodeURIComponent;
const keyOf = (it) => it.request_id + "#" + it.index;
const isMulti = (it) => Array.isArray(it.labels);
const setText = (set) => (set.length ? set.join(", ") : "(none)");
// a multi-label item's set as the person has it now (the answered set until toggled)
const pickOf = (it) => (it.pick ??= it.labels.filter((l) => typeof l === "string").slice().sort());
const pct = (x) => (num(x) === null ? "—" : (x * 100).toFixed(x >= 0.995 || x < 0.001 ? 1 : 0) + "%");

export class ReviewPanel {
  constructor(root) {
    this.root = root;
    this.model = "";
    this.strategy = "uncertain";
    this.items = [];           // the queue as last loaded, minus what was labelled
    this.cursor = 0;
    this.busy = new Set();     // keys of items whose feedback is in flight
    this.labelled = 0;         // in this tab, for this model
    this.quality = null;       // {predictions, feedback} summed over the versions
    this.labelsByVersion = new Map();
    this.names = [];
    this.loading = false;
    this.error = null;
    this.loadedOnce = false;
    this.recheck = null;
    this.serves = undefined;   // the version of the model that serves, as last seen
    this.build();
    this.render();
  }

  build() {
    this.picker = h("select", {class: "rv-model", "aria-label": "model to review",
      onchange: (ev) => this.choose(ev.target.value)});
    this.order = h("select", {class: "rv-strategy", "aria-label": "order of the queue",
      onchange: (ev) => { this.strategy = ev.target.value; this.load(); }},
    h("option", {value: "uncertain"}, "least sure first"), h("option", {value: "random"}, "random"));
    this.refresh = h("button", {class: "btn small ghost", type: "button", onclick: () => this.load()}, "Refresh");
    this.counts = h("span", {class: "rv-counts", role: "status"});
    this.list = h("ol", {class: "rv-list", onkeydown: (ev) => this.key(ev)});
    this.root.replaceChildren(
      h("div", {class: "rv-bar"}, h("label", {}, "Model ", this.picker), h("label", {}, "Order ", this.order), this.refresh, this.counts),
      h("p", {class: "rv-keys muted"}, "Click a label, or use the keys on the selected item: ",
        h("kbd", {}, "Enter"), " confirms the predicted label, ", h("kbd", {}, "1"), "–", h("kbd", {}, "9"),
        " pick a label, ", h("kbd", {}, "j"), "/", h("kbd", {}, "k"), " or arrows move, ", h("kbd", {}, "s"),
        " skips, ", h("kbd", {}, "n"), " types a new label."),
      this.list);
  }

  // called on every draw of the page: cheap unless the model names changed
  update(listing) {
    const models = Array.isArray(listing?.models) ? listing.models.filter((m) => isObj(m) && typeof m.name === "string") : [];
    this.labelsByVersion.clear();
    for (const m of models) {
      for (const v of Array.isArray(m.versions) ? m.versions : []) {
        if (isObj(v) && Array.isArray(v.labels)) this.labelsByVersion.set(m.name + "/" + v.version, v.labels.map(String));
      }
      if (Array.isArray(m.versions) && m.versions.length) {
        const last = m.versions.reduce((a, b) => ((b?.version ?? 0) > (a?.version ?? 0) ? b : a));
        if (Array.isArray(last?.labels)) this.labelsByVersion.set(m.name + "/latest", last.labels.map(String));
      }
    }
    const names = models.map((m) => m.name);
    if (names.join("\n") !== this.names.join("\n")) {
      this.names = names;
      const cur = this.model;
      this.picker.replaceChildren(...names.map((n) => h("option", {value: n}, n)));
      if (!names.length) {
        this.picker.replaceChildren(h("option", {value: ""}, "no models"));
      }
      let pick = names.includes(cur) ? cur : "";
      if (!pick) {
        const serving = isObj(listing?.serving_versions) ? Object.keys(listing.serving_versions) : [];
        pick = (listing?.default && names.includes(listing.default)) ? listing.default
          : names.find((n) => serving.includes(n)) || names[0] || "";
      }
      this.picker.value = pick;
      if (pick !== this.model) this.choose(pick);
    }
    // a new version serves: its predictions will come, look again
    const serves = isObj(listing?.serving_versions) ? listing.serving_versions[this.model] ?? null : null;
    if (serves !== this.serves) {
      const before = this.serves;
      this.serves = serves;
      if (before !== undefined && this.loadedOnce && !this.loading) this.load();
    }
  }

  choose(name) {
    this.model = name;
    this.labelled = 0;
    this.items = [];
    this.cursor = 0;
    this.load();
  }

  labelsFor(it) {
    const own = this.labelsByVersion.get(this.model + "/" + it.version) || this.labelsByVersion.get(this.model + "/latest") || [];
    const out = own.slice();
    for (const t of Array.isArray(it.top) ? it.top : []) if (isObj(t) && typeof t.label === "string" && !out.includes(t.label)) out.push(t.label);
    if (typeof it.label === "string" && !out.includes(it.label)) out.push(it.label);
    return out;
  }

  async load() {
    clearTimeout(this.recheck);
    if (!this.model) { this.items = []; this.render(); return; }
    const model = this.model;
    this.loading = true;
    this.render();
    try {
      const [queue, quality] = await Promise.all([
        api.get("/models/" + enc(model) + "/review?limit=" + LIMIT + "&strategy=" + this.strategy),
        api.get("/models/" + enc(model) + "/quality").catch((e) => { if (e.status === 401) throw e; return null; }),
      ]);
      if (model !== this.model) return;  // another model was picked meanwhile
      const had = this.items[this.cursor] ? keyOf(this.items[this.cursor]) : null;
      this.items = (Array.isArray(queue?.items) ? queue.items : [])
        .filter((it) => isObj(it) && typeof it.request_id === "string" && Number.isInteger(it.index) && !this.busy.has(keyOf(it)));
      const at = had ? this.items.findIndex((it) => keyOf(it) === had) : -1;
      this.cursor = at >= 0 ? at : Math.min(this.cursor, Math.max(0, this.items.length - 1));
      this.quality = null;
      if (isObj(quality) && Array.isArray(quality.versions)) {
        this.quality = {predictions: 0, feedback: 0};
        for (const v of quality.versions) {
          this.quality.predictions += num(v?.predictions) ?? 0;
          this.quality.feedback += num(v?.feedback) ?? 0;
        }
      }
      this.error = null;
    } catch (e) {
      if (model !== this.model) return;
      this.error = e.status === 401 ? null : e.message;
    } finally {
      if (model === this.model) {
        this.loading = false;
        this.loadedOnce = true;
        this.render();
        // an empty queue fills with new traffic: look again now and then
        if (!this.items.length && !this.error) this.recheck = setTimeout(() => this.recheckEmpty(), EMPTY_RECHECK_MS);
      }
    }
  }

  // not while the tab is hidden: wait for it to show again
  recheckEmpty() {
    if (document.hidden) this.recheck = setTimeout(() => this.recheckEmpty(), EMPTY_RECHECK_MS);
    else this.load();
  }

  toggle(it, label) {
    const set = pickOf(it);
    const at = set.indexOf(label);
    if (at >= 0) set.splice(at, 1); else { set.push(label); set.sort(); }
    this.render(true);
  }

  async label(it, label, how) {
    const k = keyOf(it);
    const multi = Array.isArray(label);
    if (this.busy.has(k) || (!multi && (typeof label !== "string" || !label.trim()))) return;
    this.busy.add(k);
    const li = this.list.querySelector(`li[data-key="${CSS.escape(k)}"]`);
    if (li) li.classList.add("sending");
    const said = multi ? setText(label) : label.trim();
    try {
      const res = await api.post("/feedback", multi
        ? {request_id: it.request_id, index: it.index, labels: label}
        : {request_id: it.request_id, index: it.index, label: label.trim()});
      const at = this.items.indexOf(it);
      if (at >= 0) {
        this.items.splice(at, 1);
        if (at < this.cursor) this.cursor--;
      }
      this.cursor = Math.min(this.cursor, Math.max(0, this.items.length - 1));
      this.labelled++;
      if (this.quality) this.quality.feedback++;
      const extra = res?.new_label ? " (a new label: a class at the next training)" : "";
      toast((how === "confirm" ? "Confirmed " : "Labelled ") + "“" + short(it.text) + "” as " + said + extra + ".", "ok");
      this.render(true);
      if (this.items.length < REFILL_BELOW) this.load();
    } catch (e) {
      if (e.status !== 401) toast("Feedback failed: " + e.message, "error");
      if (li) li.classList.remove("sending");
    } finally {
      this.busy.delete(k);
    }
  }

  key(ev) {
    if (ev.target.closest("input, select, textarea") || ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const li = ev.target.closest("li.rv-item");  // keys act on the item that has the focus
    const at = li ? this.items.findIndex((x) => keyOf(x) === li.dataset.key) : -1;
    if (at >= 0) this.cursor = at;
    const it = this.items[this.cursor];
    if (!it) return;
    let done = true;
    if (ev.key === "Enter" || ev.key === "y") {
      if (ev.target.closest("button")) return;  // a focused button clicks itself
      if (isMulti(it)) this.label(it, pickOf(it).slice(), sameSet(pickOf(it), it.labels) ? "confirm" : "pick");
      else if (typeof it.label === "string") this.label(it, it.label, "confirm");
    } else if (/^[1-9]$/.test(ev.key)) {
      const labels = this.labelsFor(it);
      const label = labels[Number(ev.key) - 1];
      if (label !== undefined && isMulti(it)) this.toggle(it, label);
      else if (label !== undefined) this.label(it, label, label === it.label ? "confirm" : "pick");
    } else if (ev.key === "j" || ev.key === "ArrowDown" || ev.key === "s") {
      this.move(1);
    } else if (ev.key === "k" || ev.key === "ArrowUp") {
      this.move(-1);
    } else if (ev.key === "n") {
      this.list.querySelector("li.cur input.rv-new")?.focus();
    } else {
      done = false;
    }
    if (done) ev.preventDefault();
  }

  move(by) {
    if (!this.items.length) return;
    this.cursor = Math.max(0, Math.min(this.items.length - 1, this.cursor + by));
    this.render(true);
  }

  select(i, focus) {
    if (i === this.cursor) return;
    this.cursor = i;
    this.render(focus);
  }

  counting() {
    const left = this.items.length;
    const parts = [this.labelled + " labelled here", (this.loading && !this.loadedOnce ? "…" : left >= LIMIT ? LIMIT + "+" : String(left)) + " left"];
    if (this.quality) parts.push(this.quality.feedback + " fed back of " + this.quality.predictions + " logged");
    this.counts.textContent = parts.join(" · ");
  }

  render(focus = false) {
    this.counting();
    this.refresh.disabled = this.loading || !this.model;
    const hadFocus = focus || this.list.contains(document.activeElement);
    if (this.error) {
      this.list.replaceChildren(h("li", {class: "empty error"}, "Cannot read the review queue: " + this.error));
      return;
    }
    if (!this.items.length) {
      const what = !this.model ? "No model in the store yet." : this.loading ? "Loading…"
        : "Nothing to review: every logged prediction of " + this.model + " has its label (or none was logged yet).";
      this.list.replaceChildren(h("li", {class: "empty" + (this.loading || !this.model ? "" : " ok")}, what));
      return;
    }
    this.list.replaceChildren(...this.items.map((it, i) => this.item(it, i)));
    const cur = this.list.querySelector("li.cur");
    if (cur && hadFocus) {
      cur.focus({preventScroll: true});
      cur.scrollIntoView({block: "nearest"});
    }
  }

  item(it, i) {
    const labels = this.labelsFor(it);
    const top = (Array.isArray(it.top) ? it.top : []).filter((t) => isObj(t) && typeof t.label === "string").slice(0, 3);
    const k = keyOf(it);
    const newLabel = h("input", {class: "rv-new", type: "text", maxlength: "200", placeholder: "new label…", "aria-label": "a label the model does not know",
      spellcheck: "false",
      onkeydown: (ev) => {
        if (ev.key === "Enter" && ev.target.value.trim()) { ev.preventDefault(); this.label(it, ev.target.value, "pick"); }
        if (ev.key === "Escape") { ev.target.value = ""; ev.target.closest("li").focus(); }
      }});
    return h("li", {class: "rv-item" + (i === this.cursor ? " cur" : "") + (this.busy.has(k) ? " sending" : ""), tabindex: i === this.cursor ? "0" : "-1",
      "data-key": k, "data-request-id": it.request_id, "data-index": String(it.index),
      onfocus: () => this.select(i, false), onclick: (ev) => { if (!ev.target.closest("button, input")) this.select(i, true); }},
    h("div", {class: "rv-text", lang: ""}, it.text ?? ""),
    h("div", {class: "rv-pred"},
      h("span", {class: "muted"}, "predicted"),
      h("strong", {class: "rv-label"}, isMulti(it) ? setText(it.labels) : it.label ?? "—"),
      h("span", {class: "rv-top"}, top.map((t) => h("span", {class: "rv-score" + (t.label === it.label ? " best" : "")},
        h("span", {class: "rv-bar-bg"}, h("span", {class: "rv-bar-fill", style: {width: Math.max(2, (num(t.score) ?? 0) * 100).toFixed(1) + "%"}})),
        t.label + " " + pct(t.score)))),
      num(it.margin) !== null ? h("span", {class: "muted rv-margin", title: "top score minus the second"}, "margin " + it.margin.toFixed(3)) : null,
      Number.isInteger(it.version) ? h("span", {class: "muted"}, "v" + it.version) : null),
    isMulti(it) ? this.setActions(it, labels, newLabel) : h("div", {class: "rv-actions"},
      typeof it.label === "string" ? h("button", {class: "btn small confirm", type: "button", title: "Enter",
        onclick: () => this.label(it, it.label, "confirm")}, "✓ " + it.label) : null,
      labels.map((l, j) => h("button", {class: "btn small ghost pick" + (l === it.label ? " predicted" : ""), type: "button",
        "data-label": l, title: j < 9 ? "key " + (j + 1) : null,
        onclick: () => this.label(it, l, l === it.label ? "confirm" : "pick")},
      j < 9 ? h("kbd", {}, String(j + 1)) : null, l)),
      newLabel));
  }

  // a multi-label item: toggles for each label, and one button that sends the set
  setActions(it, labels, newLabel) {
    const set = pickOf(it);
    const same = sameSet(set, it.labels);
    newLabel.onkeydown = (ev) => {
      if (ev.key === "Enter" && ev.target.value.trim()) {
        ev.preventDefault();
        const l = ev.target.value.trim();
        if (!set.includes(l)) { set.push(l); set.sort(); }
        ev.target.value = "";
        this.render(true);
      }
      if (ev.key === "Escape") { ev.target.value = ""; ev.target.closest("li").focus(); }
    };
    newLabel.placeholder = "add a new label…";
    return h("div", {class: "rv-actions"},
      h("button", {class: "btn small confirm send-set", type: "button", title: "Enter",
        onclick: () => this.label(it, set.slice(), same ? "confirm" : "pick")}, (same ? "✓ " : "Send ") + setText(set)),
      labels.concat(set.filter((l) => !labels.includes(l))).map((l, j) => h("button", {
        class: "btn small ghost pick toggle" + (set.includes(l) ? " on" : "") + (it.labels.includes(l) ? " predicted" : ""),
        type: "button", "data-label": l, "aria-pressed": set.includes(l) ? "true" : "false",
        title: j < 9 ? "key " + (j + 1) + ": in or out of the set" : "in or out of the set",
        onclick: () => this.toggle(it, l)},
      j < 9 ? h("kbd", {}, String(j + 1)) : null, l)),
      newLabel);
  }
}

function sameSet(a, b) {
  const x = [...a].sort(), y = [...b].sort();
  return x.length === y.length && x.every((v, i) => v === y[i]);
}

function short(text) {
  const t = String(text ?? "");
  return t.length > 40 ? t.slice(0, 39) + "…" : t;
}
