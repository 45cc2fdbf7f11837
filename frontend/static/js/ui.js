// DOM helpers and formatters. Every string from the API (model names,
// labels, reasons, texts) reaches the page as a text node: h() turns string
// children into createTextNode and sets attributes with setAttribute, never
// innerHTML, so "<script>" in a label shows as those characters.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style" && typeof v === "object") {
      for (const [p, val] of Object.entries(v)) el.style.setProperty(p, val);
    } else if (k === "value") el.value = v;
    else if (k === "checked" || k === "disabled" || k === "selected") el[k] = Boolean(v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else if (c instanceof Node) el.appendChild(c);
    else el.appendChild(document.createTextNode(String(c)));
  }
}

// Replace a container's children only when the data it shows changed: keeps
// focus, scroll and hovered buttons still between identical polls.
const lastKey = new WeakMap();
export function renderInto(el, key, build) {
  if (lastKey.get(el) === key) return false;
  lastKey.set(el, key);
  el.replaceChildren(...[].concat(build()).filter(Boolean));
  return true;
}

export function table(headers, rows, opts = {}) {
  return h("div", {class: "tablewrap"},
    h("table", {class: opts.class || ""},
      h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", {colspan: headers.length, class: "empty"}, opts.empty || "none")))));
}

export function badge(state) {
  const s = String(state ?? "?");
  return h("span", {class: "badge b-" + s.toLowerCase().replace(/[^a-z_]/g, "")}, s);
}

export const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
export const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

export function fmtBytes(b) {
  b = num(b);
  if (b === null) return "—";
  if (b < 1024) return b + " B";
  const u = ["KB", "MB", "GB", "TB"];
  let i = -1;
  do { b /= 1024; i++; } while (b >= 1024 && i < u.length - 1);
  return b.toFixed(b < 10 ? 1 : 0) + " " + u[i];
}

export function fmtNum(v, digits = 3) {
  v = num(v);
  if (v === null) return "—";
  return Number.isInteger(v) ? String(v) : v.toFixed(digits);
}

export function fmtSecs(s) {
  s = num(s);
  if (s === null) return "—";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
  if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
  if (s < 7200) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  return (s / 3600).toFixed(1) + " h";
}

export function fmtMs(ms) {
  ms = num(ms);
  return ms === null ? "—" : ms < 10 ? ms.toFixed(1) + " ms" : ms < 10000 ? ms.toFixed(0) + " ms" : (ms / 1000).toFixed(1) + " s";
}

// API times are epoch seconds (numbers) or ISO strings
export function toDate(t) {
  if (typeof t === "number") return new Date(t * 1000);
  if (typeof t === "string") { const d = new Date(t); return isNaN(d) ? null : d; }
  return null;
}

export function fmtTime(t) {
  const d = toDate(t);
  if (!d) return "—";
  const pad = (n) => String(n).padStart(2, "0");
  const today = new Date().toDateString() === d.toDateString();
  const hms = pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  return today ? hms : d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + hms;
}

export function modelRef(m) {
  if (!isObj(m)) return "—";
  return (m.name ?? "?") + (m.version !== undefined && m.version !== null ? " v" + m.version : "");
}

// A compact "k=v, k=v" line for small config objects (chosen config, params)
export function kv(obj, keys) {
  if (!isObj(obj)) return "";
  return (keys || Object.keys(obj))
    .filter((k) => obj[k] !== undefined && obj[k] !== null && !isObj(obj[k]) && !Array.isArray(obj[k]))
    .map((k) => k + "=" + (typeof obj[k] === "number" ? fmtNum(obj[k], 4) : String(obj[k])))
    .join(", ");
}

let toastTimer = null;
export function toast(message, kind = "info") {
  const el = document.getElementById("toast");
  el.textContent = message;
  el.className = "toast show t-" + kind;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { el.className = "toast"; }, kind === "error" ? 9000 : 4000);
}
