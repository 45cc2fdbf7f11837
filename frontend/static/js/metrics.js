// Live per-model figures (requests/s, p50, p99) from GET /metrics
// (Prometheus text), computed over a sliding window of scrapes: counters and
// histogram buckets are cumulative, so rates and quantiles come from the
// difference between the newest and the oldest scrape in the window. When
// /metrics is absent, requests/s come from the workers' "served" counters in
// /status and the latencies show as "—".

const WINDOW_MS = 10000;

export function parseProm(text) {
  const out = [];
  for (const line of String(text).split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[3]) {
      const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
      let l;
      while ((l = re.exec(m[3]))) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const v = m[4] === "+Inf" ? Infinity : m[4] === "-Inf" ? -Infinity : parseFloat(m[4]);
    if (!Number.isNaN(v)) out.push({name: m[1], labels, value: v});
  }
  return out;
}

const modelOf = (labels) => labels.model ?? labels.model_name ?? labels.name ?? null;

// Which series hold requests and end-to-end latency. Names are matched by
// meaning, not spelled out, so a renamed metric still shows.
function pickRequests(samples) {
  const names = new Set(samples.filter((s) => /request/.test(s.name) && /_total$/.test(s.name) && modelOf(s.labels) !== null).map((s) => s.name));
  const pref = [...names].find((n) => !/error|fail|reject/.test(n));
  return pref || null;
}

function pickLatency(samples) {
  const names = [...new Set(samples.filter((s) => /_bucket$/.test(s.name) && modelOf(s.labels) !== null).map((s) => s.name))];
  const lat = names.filter((n) => /latency|duration|seconds/.test(n) && !/apply|phase|train|batch|boot|load/.test(n));
  return lat.find((n) => /request|end_to_end|e2e|http/.test(n)) || lat.find((n) => !/model|infer|worker/.test(n)) || lat[0] || null;
}

// scrape -> {requests: {model: n}, buckets: {model: Map(le -> cumulative count)}}
function summarize(samples) {
  const reqName = pickRequests(samples);
  const latName = pickLatency(samples);
  const requests = {};
  const buckets = {};
  for (const s of samples) {
    const model = modelOf(s.labels);
    if (model === null) continue;
    if (s.name === reqName) requests[model] = (requests[model] || 0) + s.value;
    else if (s.name === latName && s.labels.le !== undefined) {
      const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
      const m = (buckets[model] ||= new Map());
      m.set(le, (m.get(le) || 0) + s.value);
    }
  }
  // a histogram's _count stands in for a missing request counter
  if (!reqName) {
    for (const s of samples) {
      const model = modelOf(s.labels);
      if (latName && s.name === latName.replace(/_bucket$/, "_count") && model !== null) requests[model] = (requests[model] || 0) + s.value;
    }
  }
  const unit = latName && /_ms$|millis/.test(latName.replace(/_bucket$/, "")) ? 1 : 1000;
  return {requests, buckets, unit};
}

function quantile(deltas, q) {
  // deltas: sorted [le, cumulative count]; linear within the bucket
  const total = deltas.length ? deltas[deltas.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let prevLe = 0, prevC = 0;
  for (const [le, c] of deltas) {
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      const span = c - prevC;
      return span > 0 ? prevLe + (le - prevLe) * ((rank - prevC) / span) : le;
    }
    prevLe = le;
    prevC = c;
  }
  return prevLe;
}

export class LiveFigures {
  constructor() { this.scrapes = []; this.served = []; }

  addMetrics(text) {
    const now = performance.now();
    this.scrapes.push({t: now, ...summarize(parseProm(text))});
    while (this.scrapes.length > 2 && now - this.scrapes[1].t >= WINDOW_MS) this.scrapes.shift();
  }

  // status fallback: served counts per model, summed over its workers
  addStatus(servedByModel) {
    const now = performance.now();
    this.served.push({t: now, requests: servedByModel});
    while (this.served.length > 2 && now - this.served[1].t >= WINDOW_MS) this.served.shift();
  }

  hasMetrics() { return this.scrapes.length > 0; }

  figures(model) {
    const out = {rps: null, p50: null, p99: null, source: null};
    const pair = (list) => (list.length >= 2 ? [list[0], list[list.length - 1]] : null);
    const mp = pair(this.scrapes);
    if (mp) {
      const [a, b] = mp;
      const dt = (b.t - a.t) / 1000;
      if (b.requests[model] !== undefined && dt > 0) {
        out.rps = Math.max(0, (b.requests[model] - (a.requests[model] || 0)) / dt);
        out.source = "metrics";
      }
      const bb = b.buckets[model];
      if (bb) {
        const ab = a.buckets[model] || new Map();
        const deltas = [...bb.entries()].sort((x, y) => x[0] - y[0]).map(([le, c]) => [le, Math.max(0, c - (ab.get(le) || 0))]);
        const unit = b.unit;
        const p50 = quantile(deltas, 0.5), p99 = quantile(deltas, 0.99);
        out.p50 = p50 === null ? null : p50 * unit;
        out.p99 = p99 === null ? null : p99 * unit;
      }
    }
    if (out.rps === null) {
      const sp = pair(this.served);
      if (sp) {
        const [a, b] = sp;
        const dt = (b.t - a.t) / 1000;
        if (dt > 0 && b.requests[model] !== undefined) {
          // a replaced worker restarts its count: never show a negative rate
          out.rps = Math.max(0, (b.requests[model] - (a.requests[model] || 0)) / dt);
          out.source = "status";
        }
      }
    }
    return out;
  }
}
