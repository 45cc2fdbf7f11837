// Calls to the management API (same origin). The bearer token (the admin or
// review key a person types in, or the session token the start URL's
// one-time code is exchanged for) lives in this tab's sessionStorage only:
// asked once, sent on every call, dropped when the service refuses it.

const KEY = "textswap.token";
const SESSION = "textswap.session";  // "1": the token is a session bought with a code
let token = sessionStorage.getItem(KEY) || "";
let authListener = () => {};
export const stats = {requests: 0, since: performance.now()};

export class ApiError extends Error {
  constructor(status, code, message, body) {
    super(message);
    this.status = status;
    this.code = code;
    this.body = body;
  }
}

export function onAuthNeeded(fn) { authListener = fn; }
export function hasToken() { return token !== ""; }

export function setToken(value, session = false) {
  token = (value || "").trim();
  if (token) sessionStorage.setItem(KEY, token);
  else sessionStorage.removeItem(KEY);
  if (token && session) sessionStorage.setItem(SESSION, "1");
  else sessionStorage.removeItem(SESSION);
}

// Drop the tab's token; a session bought with a one-time code is ended on
// the service too (POST /auth/logout), so a copy of it is worth nothing.
export async function forget() {
  if (token && sessionStorage.getItem(SESSION) === "1") {
    try { await call("POST", "/auth/logout", {}); } catch (e) { /* ended or refused already */ }
  }
  setToken("");
}

export async function call(method, path, body) {
  const headers = {Accept: "application/json"};
  if (token) headers.Authorization = "Bearer " + token;
  const init = {method, headers, cache: "no-store", credentials: "omit"};
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  stats.requests++;
  // a hung service must not stall the page's loop: give up after a while
  // (an apply may legitimately wait for a worker to boot)
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), method === "GET" ? 15000 : 180000);
  init.signal = ctl.signal;
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, "network", ctl.signal.aborted ? "no answer from the service in time"
      : "the service cannot be reached (" + (e && e.message || e) + ")");
  } finally {
    clearTimeout(timer);
  }
  const type = resp.headers.get("Content-Type") || "";
  let data = null;
  if (type.includes("json")) {
    try { data = await resp.json(); } catch { data = null; }
  } else {
    data = await resp.text();
  }
  if (resp.status === 401) {
    const had = token !== "";
    authListener(had ? "wrong" : "missing");
    throw new ApiError(401, "unauthorized", had ? "the token was refused" : "a token is needed");
  }
  if (!resp.ok) {
    const err = data && typeof data === "object" && data.error ? data.error : {};
    const message = typeof err.message === "string" ? err.message : resp.status + " " + resp.statusText;
    throw new ApiError(resp.status, typeof err.code === "string" ? err.code : "error", message, data);
  }
  return data;
}

// The URL the service prints at start carries a one-time code in its
// #fragment (never sent to a server by the browser): it is taken off the
// address bar at once and traded (POST /auth/session) for a session token.
export async function exchangeStartCode() {
  const m = /(?:^#|&)code=([A-Za-z0-9_-]+)/.exec(location.hash);
  if (!m) return;
  history.replaceState(null, "", location.pathname + location.search);
  try {
    const got = await call("POST", "/auth/session", {code: m[1]});
    if (got && typeof got.token === "string") setToken(got.token, true);
  } catch (e) {
    // a used or expired code: the page asks for a key as without one
  }
}

export const get = (path) => call("GET", path);
export const post = (path, body) => call("POST", path, body === undefined ? {} : body);
export const put = (path, body) => call("PUT", path, body === undefined ? {} : body);
export const del = (path) => call("DELETE", path);

