// Try it: type a text, pick a serving model, see its prediction (label,
// scores, abstained below a min_score you set) and why: the n-grams that
// pushed the label most, highlighted in the text by the sign and size of
// their contribution, with the bias. POST /try on the management port
// (frontend/dashboard_routes.py): /predict's body and answer, not logged, so
// what a person types here never enters the review queue or the live figures.
// Models that cannot explain (bow, cnn) answer 422 cannot_explain: the page
// says so and shows the prediction alone.

import * as api from "./api.js";
import {h, isObj, num, fmtNum} from "./ui.js";

const TOP_K = 5;

const signed = (x, d = 3) => (num(x) === null ? "—" : (x >= 0 ? "+" : "−") + Math.abs(x).toFixed(d));
const pct = (x) => (num(x) === null ? "—" : (x * 100).toFixed(1) + "%");

export class TryPanel {
  constructor(root) {
    this.root = root;
    this.names = null;
    this.seq = 0;
    this.build();
  }

  build() {
    this.text = h("textarea", {name: "text", rows: "3", maxlength: "20000", spellcheck: "false", required: true,
      placeholder: "Type a text to classify…", "aria-label": "text to classify",
      onkeydown: (ev) => { if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); this.run(); } }});
    this.model = h("select", {name: "model", "aria-label": "model"});
    this.minScore = h("input", {name: "min_score", type: "number", min: "0", max: "1", step: "0.05", placeholder: "none",
      title: "abstain when the top score is below this (empty: the model's policy, else never)"});
    this.k = h("input", {name: "explain", type: "number", min: "0", max: "100", step: "1", value: "8",
      title: "how many n-grams to show (0: no explanation)"});
    this.button = h("button", {class: "btn", type: "submit"}, "Predict");
    this.out = h("div", {class: "try-out", "aria-live": "polite"});
    this.form = h("form", {class: "try-form", autocomplete: "off", onsubmit: (ev) => { ev.preventDefault(); this.run(); }},
      this.text,
      h("div", {class: "row"},
        h("label", {}, "Model ", this.model),
        h("label", {}, "Min score ", this.minScore),
        h("label", {}, "N-grams ", this.k),
        this.button,
        h("span", {class: "muted try-hint"}, "Ctrl+Enter predicts · not logged")));
    this.root.replaceChildren(this.form, this.out);
  }

  // on every draw: the serving models (only they answer)
  update(listing) {
    const serving = isObj(listing?.serving_versions) ? Object.keys(listing.serving_versions).sort() : [];
    const sig = serving.map((n) => n + " v" + listing.serving_versions[n]).join("\n");
    if (sig === this.names) return;
    this.names = sig;
    const cur = this.model.value;
    this.model.replaceChildren(...(serving.length ? serving.map((n) => h("option", {value: n}, n + " v" + listing.serving_versions[n]))
      : [h("option", {value: ""}, "no model serves")]));
    this.model.value = serving.includes(cur) ? cur : (serving.includes(listing?.default) ? listing.default : serving[0] ?? "");
    this.button.disabled = !serving.length;
  }

  async run() {
    const text = this.text.value;
    if (!text.trim()) { this.text.focus(); return; }
    const body = {text, top_k: TOP_K};
    if (this.model.value) body.model = this.model.value;
    const ms = this.minScore.value.trim();
    if (ms !== "") {
      const v = Number(ms);
      if (!(v >= 0 && v <= 1)) { this.show(h("p", {class: "error"}, "Min score must be a number from 0 to 1.")); return; }
      body.min_score = v;
    }
    const k = Math.max(0, Math.min(100, Math.round(Number(this.k.value) || 0)));
    if (k) body.explain = k;
    const seq = ++this.seq;
    this.button.disabled = true;
    this.out.classList.add("stale");
    let res = null;
    let note = null;
    try {
      try {
        res = await api.post("/try", body);
      } catch (e) {
        if (e.code !== "cannot_explain") throw e;
        note = e.message;  // the prediction without its explanation
        delete body.explain;
        res = await api.post("/try", body);
      }
      if (seq === this.seq) this.show(this.result(text, res, note));
    } catch (e) {
      if (seq === this.seq && e.status !== 401) this.show(h("p", {class: "error"}, "Prediction failed: " + e.message));
    } finally {
      if (seq === this.seq) this.button.disabled = false;
    }
  }

  show(node) {
    this.out.classList.remove("stale");
    this.out.replaceChildren(node);
  }

  result(text, res, note) {
    const p = Array.isArray(res?.predictions) && isObj(res.predictions[0]) ? res.predictions[0] : null;
    if (!p) return h("p", {class: "error"}, "The answer held no prediction.");
    const model = isObj(res.model) ? res.model.name + " v" + res.model.version : "";
    const top = (Array.isArray(p.top) ? p.top : []).filter((t) => isObj(t) && typeof t.label === "string");
    const best = top[0]?.label ?? "";
    const head = p.abstained
      ? h("div", {class: "try-head"}, h("span", {class: "try-label abstained"}, "abstained"),
        h("span", {class: "muted"}, "top score " + pct(p.score) + " is below the min score; best guess " + best),
        h("span", {class: "muted"}, model))
      : h("div", {class: "try-head"}, h("span", {class: "try-label"}, p.label ?? "—"),
        h("span", {class: "try-score"}, pct(p.score)), h("span", {class: "muted"}, model));
    const multi = Array.isArray(p.labels) ? h("p", {class: "try-multi"}, "Labels over their thresholds: ",
      p.labels.length ? p.labels.map((l, i) => [i ? ", " : "", h("strong", {}, String(l?.label)), " " + pct(l?.score)]) : "none") : null;
    const scores = h("div", {class: "try-scores"}, top.map((t) => h("div", {class: "try-srow" + (t.label === best ? " best" : "")},
      h("span", {class: "try-sl"}, t.label),
      h("span", {class: "try-sbar"}, h("span", {style: {width: Math.max(0.5, (num(t.score) ?? 0) * 100).toFixed(1) + "%"}})),
      h("span", {class: "r"}, pct(t.score)))));
    const parts = [head, multi, scores];
    if (note) parts.push(h("p", {class: "try-note", role: "note"}, "No explanation: " + note));
    else if (isObj(p.explanation)) parts.push(explanationView(text, p.explanation));
    return h("div", {}, parts);
  }
}

// -- the explanation --------------------------------------------------------------------
const escapeRe = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

// where an n-gram occurs in the text, case-insensitively. Word n-grams are
// tokens joined by a space (the text may have punctuation, or nothing for
// Chinese, between them) and match whole words; character n-grams come from
// inside words, padded with a space where they touch a word's edge.
const CJK = /[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}]/u;
const WORDCHAR = /[\p{L}\p{N}]/u;

function occurrences(text, f) {
  const raw = String(f.ngram);
  const tokens = raw.trim().split(/\s+/).filter(Boolean);
  if (!tokens.length || raw === "[UNK]") return [];
  const first = tokens[0][0];
  const last = tokens[tokens.length - 1].slice(-1);
  const word = f.view === "word";
  // an edge is a word edge where the n-gram says so (padding) or where a word
  // n-gram ends in a letter of a script written with spaces
  const startEdge = /^\s/.test(raw) || (word && WORDCHAR.test(first) && !CJK.test(first));
  const endEdge = /\s$/.test(raw) || (word && WORDCHAR.test(last) && !CJK.test(last));
  let re;
  try {
    re = new RegExp((startEdge ? "(?<![\\p{L}\\p{N}])" : "") + tokens.map(escapeRe).join("[\\s\\p{P}\\p{S}]*") +
      (endEdge ? "(?![\\p{L}\\p{N}])" : ""), "giu");
  } catch {
    return [];
  }
  const out = [];
  for (const m of text.matchAll(re)) if (m[0].length) out.push([m.index, m.index + m[0].length]);
  return out;
}

// the text cut where the set of n-grams covering it changes; each piece with
// the summed contribution of the n-grams over it
export function highlight(text, features) {
  const n = text.length;
  const cover = Array.from({length: n}, () => []);
  features.forEach((f, i) => {
    for (const [a, b] of occurrences(text, f)) for (let c = a; c < b; c++) if (!cover[c].includes(i)) cover[c].push(i);
  });
  const pieces = [];
  let start = 0;
  for (let c = 1; c <= n; c++) {
    if (c === n || cover[c].join() !== cover[start].join()) {
      const who = cover[start];
      pieces.push({text: text.slice(start, c), features: who, sum: who.reduce((s, i) => s + (num(features[i].contribution) ?? 0), 0)});
      start = c;
    }
  }
  return pieces;
}

function shade(x, max) {
  const a = max > 0 ? Math.min(1, Math.abs(x) / max) : 0;
  // green pushes toward the label, red away; at least a tint for any n-gram shown
  return x >= 0 ? `rgba(47, 158, 68, ${(0.12 + 0.6 * a).toFixed(3)})` : `rgba(201, 42, 42, ${(0.12 + 0.6 * a).toFixed(3)})`;
}

function explanationView(text, e) {
  const features = (Array.isArray(e.features) ? e.features : []).filter((f) => isObj(f) && typeof f.ngram === "string");
  const pieces = highlight(text, features);
  const max = Math.max(0, ...pieces.map((p) => Math.abs(p.sum)));
  const shown = features.reduce((s, f) => s + (num(f.contribution) ?? 0), 0);
  const fmax = Math.max(0, ...features.map((f) => Math.abs(num(f.contribution) ?? 0)));
  const marked = h("p", {class: "try-text"}, pieces.map((p) => (p.features.length
    ? h("mark", {class: "hl " + (p.sum >= 0 ? "pos" : "neg"), style: {background: shade(p.sum, max)},
      "data-contribution": p.sum.toFixed(6),
      title: p.features.map((i) => features[i].ngram + " " + signed(features[i].contribution)).join("\n")}, p.text)
    : p.text)));
  const rows = features.map((f) => {
    const c = num(f.contribution) ?? 0;
    const w = fmax > 0 ? (50 * Math.abs(c)) / fmax : 0;
    return h("tr", {},
      h("td", {}, f.ngram === "[UNK]" ? h("span", {class: "muted", title: "n-grams the model has no weight for"}, "unknown n-grams")
        : h("code", {class: "ngram"}, f.ngram)),
      h("td", {class: "muted"}, f.view ?? ""),
      h("td", {class: "try-cbar"}, h("span", {class: "axis"}), h("span", {class: "cb " + (c >= 0 ? "pos" : "neg"),
        style: c >= 0 ? {left: "50%", width: w.toFixed(1) + "%"} : {left: (50 - w).toFixed(1) + "%", width: w.toFixed(1) + "%"}})),
      h("td", {class: "r"}, signed(c)),
      h("td", {class: "r muted vw"}, fmtNum(f.value, 3) + " × " + fmtNum(f.weight, 3)));
  });
  return h("div", {class: "try-explain"},
    h("h4", {}, "Why " + (e.label ?? "this label")),
    marked,
    h("p", {class: "try-legend muted"}, h("span", {class: "sw pos"}), " pushes toward ", String(e.label ?? ""), "  ",
      h("span", {class: "sw neg"}), " pushes away; the stronger the colour, the larger the contribution. Hover a highlight for its n-grams."),
    features.length ? h("div", {class: "tablewrap"}, h("table", {class: "try-features"},
      h("thead", {}, h("tr", {}, h("th", {}, "n-gram"), h("th", {}, "view"), h("th", {}, "contribution"), h("th", {class: "r"}, ""), h("th", {class: "r vw"}, "value × weight"))),
      h("tbody", {}, rows))) : h("p", {class: "empty"}, "No n-gram of this text is known to the model."),
    h("p", {class: "try-sum"}, "bias ", h("strong", {}, signed(e.bias)), " + these ", String(features.length), " n-grams ",
      h("strong", {}, signed(shown)), " + the other n-grams ", h("strong", {}, signed(e.others)),
      " = logit ", h("strong", {}, signed(e.logit)), " for ", String(e.label ?? "")));
}
