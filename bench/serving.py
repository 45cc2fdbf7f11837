"""Serving benchmark: throughput, latency, applies and memory of the real service.

    .venv/bin/python -m bench.serving            # full run, about 5 minutes
    .venv/bin/python -m bench.serving --quick    # short smoke run
    .venv/bin/python -m bench.serving --loops    # event loop and JSON only, ~6 minutes
    make bench

Everything runs on this machine, against 127.0.0.1 only. The bench trains two
real versions of a model through the service's own /train path (bundled
Chinese review sentiment data), then measures the service against baselines
taken in the same run, so the ratios mean something on any machine:

  1. single-text POST /predict vs. a bare Tornado JSON echo handler (its own
     process): requests/s at concurrency 64, p99 latency at concurrency 8
  2. POST /predict with 256 texts per request vs. the same model called
     in-process (keras.saving.load_model + textmodel.make_predict_fn)
  3. POST /apply: time until /predict answers from the new version, with the
     warm standby (median of several) and without one (worker.standby false)
  4. throughput around a swap under steady load, and failed requests
  5. resident memory of the supervisor and of the serving worker
  6. the ecosystem (also alone: --ecosystem): single-text /predict with
     Prometheus metrics on vs the same service with metrics.enabled false
     (budget: at most 3% fewer req/s), and Open Inference Protocol infer
     (JSON tensors) vs /predict, 1 and 256 texts; runs interleaved, medians
  7. the event loop and JSON (alone: --loops): single text at c64 (log on)
     and 256 texts at c4 on six services alike but for server.event_loop
     (asyncio, uvloop), TEXTSWAP_JSON (stdlib, orjson), server.http_parser
     (tornado, httptools) and worker.engine (keras, lean): as before, each
     change alone, the three, and all four (the default); against the bare
     Tornado echo on asyncio's default loop, interleaved rounds, medians; and
     the request path's JSON calls timed in-process

The load generator is wrk (Debian package `wrk`) with a generated Lua script,
or, where wrk is missing, a keep-alive HTTP/1.1 client on asyncio in its own
process. Either way it shares the CPUs with the server, for the baseline and
for the service alike. Results: a table on stdout and JSON in bench/results/.

Internal modes (used by the bench itself, each in its own process):
  --echo-server PORT, --model-speed MODEL_DIR, --loadgen-client SPEC_JSON
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
# the bench's data, read by /train from a data root the bench configures
DATA_REL = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
CACHE = os.path.join(ROOT, "bench", ".cache", "serving-models")
RESULTS = os.path.join(ROOT, "bench", "results")
MODEL = "demo"
# the second version: same data, different training, so it is a new artifact; `bow` like the
# demo model (the default `auto` would search and serve a different, costlier graph)
V2_PARAMS = {"architecture": "bow", "epochs": 6, "seed": 7}

BATCH_TEXTS = 256
CONC_THROUGHPUT = 64
CONC_LATENCY = 8
CONC_BATCH = 4
CONC_SWAP = 32
BINS_PER_S = 10  # timeline resolution of the swap test

# the targets: (key, description, limit)
TARGETS = {
    "single_rps": ">= 80% of bare Tornado req/s at c64",
    "single_p99": "p99 <= 2x bare Tornado p99 at c8",
    "batch_tps": ">= 50% of in-process texts/s, 256 texts/request",
    "apply_warm": "median call -> serving new version <= 1 s (standby)",
    "apply_cold": "cold apply (standby false) works",
    "swap_dip": "throughput dip around a swap <= 20%",
    "swap_errors": "0 failed requests during the swap run",
    "sup_rss": "supervisor RSS < 80 MB",
    "metrics_overhead": "metrics on >= 97% of off, 1 text req/s at c64",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Request bodies: real texts from the bundled data
# ---------------------------------------------------------------------------

def read_texts(limit: int = 3000) -> list[str]:
    texts = []
    with open(DATA, encoding="utf-8") as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            if len(texts) >= limit:
                break
    return texts


def write_bodies(path: str, bodies: list[Any]) -> str:
    """One JSON body per line, ASCII only (\\u escapes), for wrk and the client."""
    with open(path, "w", encoding="ascii") as fh:
        for b in bodies:
            fh.write(json.dumps(b, ensure_ascii=True) + "\n")
    return path


# ---------------------------------------------------------------------------
# Baseline 1: a bare Tornado JSON echo handler (its own process)
# ---------------------------------------------------------------------------

def echo_server(port: int) -> None:
    from tornado.ioloop import IOLoop
    from tornado.web import Application, RequestHandler

    class Echo(RequestHandler):
        def post(self) -> None:
            data = json.loads(self.request.body)
            self.set_header("Content-Type", "application/json; charset=utf-8")
            self.finish(json.dumps({"ok": True, "received": data}, ensure_ascii=False))

    Application([(r"/predict", Echo)]).listen(port, address="127.0.0.1")
    signal.signal(signal.SIGTERM, lambda *_: IOLoop.current().add_callback_from_signal(
        IOLoop.current().stop))
    IOLoop.current().start()


# ---------------------------------------------------------------------------
# Baseline 2: the same model called in-process, batches of 256
# ---------------------------------------------------------------------------

def model_speed(model_dir: str, seconds: float) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from model_worker import textmodel

    texts = read_texts()
    model = keras.saving.load_model(os.path.join(model_dir, "model.keras"), safe_mode=True)
    predict = textmodel.make_predict_fn(model)
    batches = [texts[i:i + BATCH_TEXTS] for i in range(0, len(texts) - BATCH_TEXTS + 1,
                                                       BATCH_TEXTS)]
    for b in batches[:3]:  # trace and warm up
        predict(b)
    n = calls = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds and calls < 1_000_000:
        predict(batches[calls % len(batches)])
        n += BATCH_TEXTS
        calls += 1
    dt = time.monotonic() - t0
    print("RESULT " + json.dumps({"texts": n, "calls": calls, "seconds": dt,
                                  "texts_per_s": n / dt,
                                  "ms_per_call": 1000 * dt / max(calls, 1)}), flush=True)


# ---------------------------------------------------------------------------
# Load generators
# ---------------------------------------------------------------------------

WRK_LUA = r"""
-- generated by bench/serving.py: POST bodies from a file, one per line
local bodies_path = "%(bodies)s"
local timeline = %(timeline)s
local reqs, n, i = {}, 0, 0

function init(args)
  for line in io.lines(bodies_path) do
    n = n + 1
    reqs[n] = wrk.format("POST", nil, {["Content-Type"] = "application/json"}, line)
  end
  i = math.random(n) - 1
end

function request()
  i = i + 1
  if i > n then i = 1 end
  return reqs[i]
end

bins, bad = {}, 0
if timeline then
  local ffi = require("ffi")
  ffi.cdef[[ typedef struct { long tv_sec; long tv_nsec; } bench_ts;
             int clock_gettime(int, bench_ts *); ]]
  local ts = ffi.new("bench_ts")
  -- CLOCK_MONOTONIC (1), the clock of Python's time.monotonic()
  function response(status, headers, body)
    ffi.C.clock_gettime(1, ts)
    local b = math.floor((tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9) * %(bins_per_s)d)
    bins[b] = (bins[b] or 0) + 1
    if status ~= 200 then bad = bad + 1 end
  end
end

local threads = {}
function setup(thread) table.insert(threads, thread) end

function done(summary, latency, requests)
  local merged, nbad = {}, 0
  for _, t in ipairs(threads) do
    nbad = nbad + (t:get("bad") or 0)
    for k, v in pairs(t:get("bins") or {}) do merged[k] = (merged[k] or 0) + v end
  end
  local parts = {}
  for k, v in pairs(merged) do parts[#parts + 1] = string.format('"%%d": %%d', k, v) end
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %%d, "duration_s": %%.6f, ' ..
    '"errors": {"connect": %%d, "read": %%d, "write": %%d, "status": %%d, "timeout": %%d}, ' ..
    '"latency_ms": {"p50": %%.3f, "p90": %%.3f, "p99": %%.3f, "max": %%.3f, "mean": %%.3f}, ' ..
    '"bad_status": %%d, "bins": {%%s}}\n',
    summary.requests, summary.duration / 1e6, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50) / 1e3, latency:percentile(90) / 1e3, latency:percentile(99) / 1e3,
    latency.max / 1e3, latency.mean / 1e3, nbad, table.concat(parts, ", ")))
end
"""


def _summarize(raw: dict[str, Any], texts_per_request: int) -> dict[str, Any]:
    e = raw["errors"]
    errors = sum(e.values()) + (raw.get("bad_status", 0) if not e.get("status") else 0)
    rps = raw["requests"] / raw["duration_s"] if raw["duration_s"] else 0.0
    return {"requests": raw["requests"], "seconds": round(raw["duration_s"], 3),
            "rps": rps, "texts_per_s": rps * texts_per_request,
            "p50_ms": raw["latency_ms"]["p50"], "p90_ms": raw["latency_ms"]["p90"],
            "p99_ms": raw["latency_ms"]["p99"], "max_ms": raw["latency_ms"]["max"],
            "errors": errors, "error_detail": e,
            **({"bins": {int(k): v for k, v in raw["bins"].items()}} if raw.get("bins") else {})}


class LoadGen:
    """Runs one load test: wrk when installed, else the asyncio client."""

    def __init__(self, kind: str, workdir: str) -> None:
        self.kind = kind
        self.workdir = workdir

    def start(self, port: int, bodies: str, conc: int, seconds: float,
              timeline: bool = False, path: str = "/predict") -> subprocess.Popen:
        url = f"http://127.0.0.1:{port}{path}"
        if self.kind == "wrk":
            script = os.path.join(self.workdir, f"wrk-{os.path.basename(bodies)}-{timeline}.lua")
            with open(script, "w", encoding="utf-8") as fh:
                fh.write(WRK_LUA % {"bodies": bodies, "timeline": "true" if timeline else "false",
                                    "bins_per_s": BINS_PER_S})
            cmd = ["wrk", "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--timeout", "30s",
                   "-s", script, url]
        else:
            spec = {"port": port, "bodies": bodies, "conc": conc, "seconds": seconds,
                    "timeline": timeline, "path": path}
            cmd = [sys.executable, "-m", "bench.serving", "--loadgen-client",
                   json.dumps(spec)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT)

    @staticmethod
    def result(proc: subprocess.Popen, seconds: float, texts_per_request: int) -> dict[str, Any]:
        out, _ = proc.communicate(timeout=seconds + 60)
        for line in out.splitlines():
            if line.startswith("WRKJSON "):
                return _summarize(json.loads(line[8:]), texts_per_request)
        raise RuntimeError(f"load generator gave no result (exit {proc.returncode}):\n{out}")

    def run(self, port: int, bodies: str, conc: int, seconds: float,
            texts_per_request: int = 1, timeline: bool = False,
            pids: dict[str, int] | None = None, path: str = "/predict") -> dict[str, Any]:
        """One load test; `pids`: server processes whose CPU time per request to report."""
        before = cpu_seconds(pids or {})
        proc = self.start(port, bodies, conc, seconds, timeline, path)
        res = self.result(proc, seconds, texts_per_request)
        after = cpu_seconds(pids or {})
        n = max(res["requests"], 1)
        res["cpu_ms_per_request"] = {k: 1000 * (after[k] - before[k]) / n for k in before
                                     if k in after}
        return res


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process: a cost that contention does not hide."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            pass
    return out


def loadgen(spec: dict[str, Any]) -> None:
    """Fallback client: keep-alive HTTP/1.1 on raw sockets, bounded by time and count."""
    port, conc, seconds = spec["port"], spec["conc"], spec["seconds"]
    with open(spec["bodies"], encoding="ascii") as fh:
        bodies = [line.rstrip("\n").encode() for line in fh if line.strip()]
    reqs = [(f"POST {spec.get('path', '/predict')} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
             f"Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n").encode() + b
            for b in bodies]
    lat: list[float] = []
    bins: dict[int, int] = {}
    errors = {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0}
    max_requests = 5_000_000

    async def client(k: int, deadline: float) -> None:
        i = k * 7919
        conn = None
        while time.monotonic() < deadline and len(lat) < max_requests:
            if conn is None:
                try:
                    conn = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
                except (OSError, asyncio.TimeoutError):
                    errors["connect"] += 1
                    await asyncio.sleep(0.01)
                    continue
            reader, writer = conn
            i += 1
            t0 = time.monotonic()
            try:
                writer.write(reqs[i % len(reqs)])
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await asyncio.wait_for(reader.readexactly(length), 30)
            except asyncio.TimeoutError:
                errors["timeout"] += 1
                writer.close()
                conn = None
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors["read"] += 1
                writer.close()
                conn = None
                continue
            t1 = time.monotonic()
            lat.append(t1 - t0)
            if head[9:12] != b"200":
                errors["status"] += 1
            if spec["timeline"]:
                b = int(t1 * BINS_PER_S)
                bins[b] = bins.get(b, 0) + 1
        if conn is not None:
            conn[1].close()

    async def main() -> float:
        t0 = time.monotonic()
        await asyncio.gather(*(client(k, t0 + seconds) for k in range(conc)))
        return time.monotonic() - t0

    dt = asyncio.run(main())
    lat.sort()

    def pct(p: float) -> float:
        return 1000 * lat[min(len(lat) - 1, int(p / 100 * len(lat)))] if lat else 0.0

    print("WRKJSON " + json.dumps({
        "requests": len(lat), "duration_s": dt, "errors": errors,
        "latency_ms": {"p50": pct(50), "p90": pct(90), "p99": pct(99),
                       "max": 1000 * lat[-1] if lat else 0.0,
                       "mean": 1000 * statistics.fmean(lat) if lat else 0.0},
        "bad_status": errors["status"], "bins": bins}), flush=True)


# ---------------------------------------------------------------------------
# The service under test
# ---------------------------------------------------------------------------

def write_config(path: str, models_dir: str, standby: bool, metrics: bool = True,
                 server: dict[str, Any] | None = None, engine: str | None = None) -> str:
    import yaml

    cfg: dict[str, Any] = {
        "models_dir": models_dir,
        "worker": {"standby": standby},
        "metrics": {"enabled": metrics},
        # both training jobs at once: setup takes one training time, not two
        "training": {"max_concurrent": 2, "demo_on_empty_store": True,
                     "data_roots": [os.path.join(ROOT, "data")]},
        "watcher": {"enabled": False},
        "log_level": "WARNING",
    }
    if server:
        cfg["server"] = dict(server)
    if engine:
        cfg["worker"]["engine"] = engine
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh)
    return path


class RssSampler(threading.Thread):
    """Peak RSS of the supervisor and of each child, sampled every 0.25 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stop_event = threading.Event()
        self.sup_peak = 0
        self.child_peak: dict[int, int] = {}

    def run(self) -> None:
        import psutil

        for _ in range(20_000):  # bounded: 20k samples x 0.25 s
            if self.stop_event.wait(0.25):
                return
            try:
                p = psutil.Process(self.pid)
                self.sup_peak = max(self.sup_peak, p.memory_info().rss)
                for c in p.children():
                    try:
                        rss = c.memory_info().rss
                    except psutil.Error:
                        continue
                    self.child_peak[c.pid] = max(self.child_peak.get(c.pid, 0), rss)
            except psutil.Error:
                return


def wait_models(svc: Any, deadline_s: float) -> dict[str, Any]:
    """Both training jobs done and a model serving; fail loudly otherwise."""
    from tests.helpers import wait_for

    def check() -> Any:
        st = svc.status()
        jobs = st["jobs"]
        bad = [j for j in jobs if j["state"] in ("failed", "cancelled")]
        if bad:
            raise SystemExit(f"training failed: {bad[0].get('error')}\n{bad[0].get('log_tail')}")
        if len(jobs) >= 2 and all(j["state"] == "succeeded" for j in jobs) and st["serving"]:
            return st
        return None

    return wait_for(check, deadline_s, "two trained versions and a serving model", interval=0.5)


def versions(svc: Any) -> list[int]:
    code, body = svc.mget(f"/models/{MODEL}")
    assert code == 200, body
    return sorted(v["version"] if isinstance(v, dict) else v for v in body["versions"])


class ServingPoller:
    """Polls /predict until it answers from `version`; time since `t_call`."""

    def __init__(self, port: int, text: str) -> None:
        self.port = port
        self.body = json.dumps({"text": text})

    def wait_version(self, version: int, t_call: float, timeout: float = 120.0) -> float | None:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            for _ in range(int(timeout / 0.002)):
                if time.monotonic() - t_call > timeout:
                    return None
                try:
                    conn.request("POST", "/predict", self.body,
                                 {"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    data = json.loads(resp.read())
                except (OSError, http.client.HTTPException, ValueError):
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                    continue
                now = time.monotonic()
                if resp.status == 200 and data["model"]["version"] == version:
                    return now - t_call
                time.sleep(0.002)
            return None
        finally:
            conn.close()


def timed_apply(svc: Any, version: int, poller: ServingPoller) -> dict[str, Any]:
    """POST /apply in a thread; the caller's thread times when the new version serves."""
    from tests.helpers import request

    box: dict[str, Any] = {}

    def call() -> None:
        t = time.monotonic()
        box["code"], box["body"] = request(svc.mport, "POST", "/apply",
                                           {"name": MODEL, "version": version}, timeout=180)
        box["http_s"] = time.monotonic() - t

    th = threading.Thread(target=call, daemon=True)
    t_call = time.monotonic()
    th.start()
    to_serving = poller.wait_version(version, t_call)
    th.join(200)
    body = box.get("body") or {}
    if box.get("code") != 200:
        raise SystemExit(f"apply of v{version} failed: {box.get('code')} {body}")
    ph = body.get("phases_s", {})
    return {"version": version, "t_call": t_call, "to_serving_s": to_serving,
            "to_swap_s": sum(ph.get(k, 0.0) for k in ("queued", "spawn", "load", "swap")),
            "http_s": box["http_s"], "phases_s": ph, "load_s": body.get("load_s"),
            "warmup_s": body.get("warmup_s")}


def start_service(workdir: str, models_dir: str, standby: bool, tag: str,
                  metrics: bool = True, server: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None, engine: str | None = None) -> Any:
    from tests.helpers import Service

    cfg = write_config(os.path.join(workdir, f"config-{tag}.yaml"), models_dir, standby,
                       metrics, server, engine)
    t0 = time.monotonic()
    svc = Service(models_dir, args=["--config", cfg], env=env,
                  log_path=os.path.join(workdir, f"service-{tag}.log"))
    # the supervisor imports no TensorFlow: /healthz answers within about 1 s on
    # an idle machine (tests/test_lifecycle.py checks the memory, not this time)
    svc.healthz_s = time.monotonic() - t0
    print(f"[{tag}] supervisor answered /healthz {svc.healthz_s:.2f} s after its start",
          flush=True)
    return svc


def prepare_models(workdir: str, reuse: bool) -> tuple[str, bool]:
    """A models dir with two versions: from the cache, or trained now."""
    models_dir = os.path.join(workdir, "models")
    if reuse and os.path.isdir(os.path.join(CACHE, MODEL)):
        shutil.copytree(CACHE, models_dir)
        return models_dir, False
    os.makedirs(models_dir)
    return models_dir, True


def save_cache(models_dir: str) -> None:
    shutil.rmtree(CACHE, ignore_errors=True)
    os.makedirs(CACHE)
    shutil.copytree(os.path.join(models_dir, MODEL), os.path.join(CACHE, MODEL))
    rec = os.path.join(models_dir, ".applied.json")
    if os.path.exists(rec):
        shutil.copy(rec, CACHE)


# ---------------------------------------------------------------------------
# Profiling (optional): py-spy on the supervisor and the serving worker
# ---------------------------------------------------------------------------

def profile_run(gen: LoadGen, svc: Any, bodies: str, conc: int, seconds: float, out: str,
                tag: str, texts_per_request: int) -> dict[str, Any]:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        log("py-spy not found: pip install py-spy into the venv; skipping the profile")
        return {}
    os.makedirs(out, exist_ok=True)
    worker = svc.status()["serving"]["pid"]
    spies = []
    for who, pid in (("supervisor", svc.proc.pid), ("worker", worker)):
        # collapsed stacks (text); `py-spy record --format flamegraph` makes an SVG
        path = os.path.join(out, f"{tag}-{who}.txt")
        spies.append(subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", "100", "--nonblocking",
             "--duration", str(int(seconds)), "--format", "raw", "-o", path],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches
    res = gen.run(svc.port, bodies, conc, seconds, texts_per_request)
    for s in spies:
        try:
            s.wait(seconds + 30)
        except subprocess.TimeoutExpired:
            s.kill()
    return res


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def swap_analysis(bins: dict[int, int], t_call: float, t_swap: float, t_done: float,
                  ) -> dict[str, Any]:
    """Requests/s in the windows around the swap vs. the steady state before it."""
    if not bins:
        return {}
    lo, hi = min(bins), max(bins)
    w = 1.0 / BINS_PER_S

    def rate(a: float, b: float) -> float:
        ia, ib = int(a * BINS_PER_S), int(b * BINS_PER_S)
        n = sum(bins.get(i, 0) for i in range(ia, ib))
        return n / max(w, (ib - ia) * w)

    start = lo / BINS_PER_S + 1.0  # skip the first second (connections, warm-up)
    steady = rate(start, t_call - 0.2)
    # the window that must hold up: from the call until 1 s after the swap, at least 2 s
    win_end = max(t_call + 2.0, t_swap + 1.0)
    around = rate(t_call, win_end)
    after = rate(win_end, min(hi / BINS_PER_S, win_end + 4.0))
    # worst half second from the call to the end of the run
    worst = min((rate(a / BINS_PER_S, a / BINS_PER_S + 0.5)
                 for a in range(int(t_call * BINS_PER_S), hi - 5)), default=around)
    return {"steady_rps": steady, "around_rps": around, "window_s": [0.0, win_end - t_call],
            "after_rps": after, "worst_500ms_rps": worst,
            "dip": 1.0 - around / steady if steady else None,
            "worst_dip": 1.0 - worst / steady if steady else None,
            "timeline": [[round(i / BINS_PER_S - t_call, 2), bins.get(i, 0) * BINS_PER_S]
                         for i in range(lo, hi + 1)]}


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    dur = 3.0 if quick else 10.0
    warm = 1.0 if quick else 2.0
    n_warm_applies = 2 if quick else 5
    n_cold_applies = 1  # a cold start costs a TensorFlow import: tens of seconds
    swap_run = 8.0 if quick else 14.0
    kind = args.loadgen or ("wrk" if shutil.which("wrk") else "python")
    workdir = tempfile.mkdtemp(prefix="textswap-bench-")
    gen = LoadGen(kind, workdir)
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "loadgen": kind, "durations_s": {"measure": dur, "warmup": warm}}
    log(f"textswap serving bench ({'quick' if quick else 'full'}); load generator: {kind}; "
        f"work dir {workdir}")

    texts = read_texts()
    single = write_bodies(os.path.join(workdir, "single.jsonl"),
                          [{"text": t} for t in texts[:2000]])
    batched = write_bodies(os.path.join(workdir, "batch.jsonl"),
                           [{"texts": [texts[(i * BATCH_TEXTS + j) % len(texts)]
                                       for j in range(BATCH_TEXTS)]} for i in range(40)])

    # -- setup: two real versions ------------------------------------------------------
    t0 = time.monotonic()
    models_dir, train = prepare_models(workdir, reuse=args.reuse_models or quick)
    svc = start_service(workdir, models_dir, standby=True, tag="warm")
    sampler = RssSampler(svc.proc.pid)
    sampler.start()
    cold_svc = None
    try:
        if train:
            log("training v1 (demo on empty store) and v2 (POST /train) with the trainer ...")
            code, body = svc.mpost("/train", {"name": MODEL, "data": {"path": DATA_REL},
                                              "params": V2_PARAMS, "apply": False})
            assert code == 202, body
            st = wait_models(svc, 600)
            save_cache(models_dir)
            results["training"] = [{k: j.get(k) for k in ("id", "state", "elapsed_s", "result")}
                                   for j in st["jobs"]]
        else:
            log(f"reusing trained models from {CACHE} (full run without --reuse-models "
                f"trains them)")
            from tests.helpers import wait_for
            wait_for(lambda: svc.status()["serving"], 180, "the startup apply", interval=0.2)
        vs = versions(svc)
        assert len(vs) >= 2, f"need two versions, have {vs}"
        svc.wait_standby(180)
        st = svc.status()
        results["setup"] = {"seconds": round(time.monotonic() - t0, 1), "trained": train,
                            "versions": vs, "serving": st["serving"]}
        log(f"setup done in {time.monotonic() - t0:.0f}s: versions {vs}, serving "
            f"v{st['serving']['version']}, standby ready")
        time.sleep(1.0)

        runs: dict[str, Any] = {}

        # -- 1. bare Tornado baseline ----------------------------------------------------
        from tests.helpers import free_port, wait_for
        eport = free_port()
        echo = subprocess.Popen([sys.executable, "-m", "bench.serving", "--echo-server",
                                 str(eport)], cwd=ROOT)
        try:
            wait_for(lambda: _port_open(eport), 20, "echo server")
            for conc in (CONC_THROUGHPUT, CONC_LATENCY):
                gen.run(eport, single, conc, warm)
                runs[f"echo_c{conc}"] = r = gen.run(eport, single, conc, dur,
                                                    pids={"echo": echo.pid})
                log(f"bare tornado c{conc}: {r['rps']:.0f} req/s, p99 {r['p99_ms']:.1f} ms")
        finally:
            echo.terminate()
            echo.wait(10)

        # -- 1. service, single text -----------------------------------------------------
        pids = {"supervisor": svc.proc.pid, "worker": svc.status()["serving"]["pid"]}
        for conc in (CONC_THROUGHPUT, CONC_LATENCY):
            gen.run(svc.port, single, conc, warm)
            runs[f"single_c{conc}"] = r = gen.run(svc.port, single, conc, dur, pids=pids)
            log(f"service single c{conc}: {r['rps']:.0f} req/s, p99 {r['p99_ms']:.1f} ms, "
                f"errors {r['errors']}")

        # -- 2. batched: in-process model vs. service ---------------------------------------
        serving = svc.status()["serving"]
        mdir = os.path.join(models_dir, MODEL, str(serving["version"]))
        out = subprocess.run([sys.executable, "-m", "bench.serving", "--model-speed", mdir,
                              "--seconds", str(dur)], capture_output=True, text=True,
                             timeout=dur + 180, cwd=ROOT)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"in-process model run failed:\n{out.stdout}\n{out.stderr}")
        inproc = json.loads(line[-1][7:])
        runs["inprocess_b256"] = {"texts_per_s": inproc["texts_per_s"],
                                  "rps": inproc["texts_per_s"] / BATCH_TEXTS,
                                  "p50_ms": inproc["ms_per_call"], "requests": inproc["calls"],
                                  "errors": 0}
        log(f"in-process model b{BATCH_TEXTS}: {inproc['texts_per_s']:.0f} texts/s "
            f"({inproc['ms_per_call']:.1f} ms/call)")
        # a request takes a large part of a second: run long enough to finish many
        bdur = max(dur, 8.0)
        gen.run(svc.port, batched, CONC_BATCH, warm, BATCH_TEXTS)
        runs[f"batch_c{CONC_BATCH}"] = r = gen.run(svc.port, batched, CONC_BATCH, bdur,
                                                   BATCH_TEXTS, pids=pids)
        log(f"service b{BATCH_TEXTS} c{CONC_BATCH}: {r['texts_per_s']:.0f} texts/s, "
            f"p99 {r['p99_ms']:.1f} ms, errors {r['errors']}")

        # -- 2b. ecosystem: metrics on vs off, OIP vs /predict ---------------------------------
        results["ecosystem"] = ecosystem_runs(gen, svc, workdir, models_dir, texts, single,
                                              batched, dur, warm, 1 if quick else args.rounds)

        # -- profile (optional, not part of the measured numbers) ---------------------------
        if args.profile:
            pdir = os.path.join(RESULTS, f"profile-{time.strftime('%Y%m%d-%H%M%S')}")
            log(f"profiling with py-spy into {pdir} ...")
            pdur = max(dur, 10.0)
            results["profile_runs"] = {
                "single_c64": profile_run(gen, svc, single, CONC_THROUGHPUT, pdur, pdir,
                                          "single_c64", 1),
                "batch_c4": profile_run(gen, svc, batched, CONC_BATCH, pdur, pdir, "batch_c4",
                                        BATCH_TEXTS)}
            results["profile_dir"] = pdir

        # -- 3. applies with the warm standby -------------------------------------------------
        poller = ServingPoller(svc.port, texts[0])
        applies = []
        for i in range(n_warm_applies):
            svc.wait_standby(180)
            cur = svc.status()["serving"]["version"]
            target = [v for v in vs if v != cur][-1]
            a = timed_apply(svc, target, poller)
            applies.append(a)
            log(f"warm apply -> v{target}: serving after {a['to_serving_s']:.3f}s "
                f"(apply answered after {a['http_s']:.3f}s; phases {a['phases_s']})")
        results["applies_warm"] = applies

        # -- 4. a swap under steady load ------------------------------------------------------
        svc.wait_standby(180)
        time.sleep(0.5)
        cur = svc.status()["serving"]["version"]
        target = [v for v in vs if v != cur][-1]
        proc = gen.start(svc.port, single, CONC_SWAP, swap_run, timeline=True)
        time.sleep(swap_run * 0.4)
        a = timed_apply(svc, target, poller)
        t_swap = a["t_call"] + (a["to_serving_s"] or a["to_swap_s"])
        r = gen.result(proc, swap_run, 1)
        sw = swap_analysis(r.pop("bins", {}), a["t_call"], t_swap, a["t_call"] + a["http_s"])
        runs[f"swap_c{CONC_SWAP}"] = r
        results["swap"] = {"apply": a, **sw}
        log(f"swap under load c{CONC_SWAP}: steady {sw['steady_rps']:.0f} req/s, around the "
            f"swap {sw['around_rps']:.0f} req/s (dip {100 * sw['dip']:.1f}%), worst 0.5 s "
            f"{sw['worst_500ms_rps']:.0f} req/s, errors {r['errors']}")

        # -- 5. memory ------------------------------------------------------------------------
        st = svc.status()
        wpid = st["serving"]["pid"]
        sampler.stop_event.set()
        sampler.join(5)
        results["memory"] = {
            "supervisor_rss_peak": sampler.sup_peak,
            "supervisor_rss_now": st["supervisor"]["rss_bytes"],
            "worker_rss_now": next((w["rss_bytes"] for w in st["workers"] if w["pid"] == wpid),
                                   None),
            "worker_rss_peak": max(sampler.child_peak.values(), default=None),
            "children_rss_peak": sampler.child_peak}
        svc.stop()
        svc = None

        # -- 3b. cold applies (worker.standby false) ---------------------------------------
        log("cold applies: restarting the service with worker.standby false ...")
        cold_svc = start_service(workdir, models_dir, standby=False, tag="cold")
        wait_for(lambda: cold_svc.status()["serving"], 180, "the startup apply", interval=0.2)
        cold_poller = ServingPoller(cold_svc.port, texts[0])
        cold = []
        for i in range(n_cold_applies):
            cur = cold_svc.status()["serving"]["version"]
            target = [v for v in vs if v != cur][-1]
            a = timed_apply(cold_svc, target, cold_poller)
            cold.append(a)
            log(f"cold apply -> v{target}: serving after {a['to_serving_s']:.3f}s "
                f"(phases {a['phases_s']})")
        results["applies_cold"] = cold
        cold_svc.stop()
        cold_svc = None
    finally:
        sampler.stop_event.set()
        for s in (svc, cold_svc):
            if s is not None:
                s.stop()

    results["runs"] = runs
    results["targets"] = evaluate(results)
    print_report(results)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"serving-{time.strftime('%Y%m%d-%H%M%S')}"
                                 f"{'-quick' if quick else ''}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(t["pass"] for t in results["targets"].values()) else 1


# ---------------------------------------------------------------------------
# Ecosystem: metrics on vs off, Open Inference Protocol vs /predict
# ---------------------------------------------------------------------------

OIP_PATH = f"/v2/models/{MODEL}/infer"


def _oip_body(texts: list[str]) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}]}


def _alternate(gen: LoadGen, plans: list[tuple[str, int, str, str, int, int, dict[str, int]]],
               dur: float, warm: float, rounds: int) -> dict[str, Any]:
    """Each plan (label, port, path, bodies, conc, texts/request, pids) run `rounds`
    times, interleaved (ABBA), so that drift of a shared machine hits all of them
    alike; the medians of the rounds."""
    for _, port, path, bodies, conc, n, _ in plans:
        gen.run(port, bodies, conc, warm, n, path=path)
    got: dict[str, list[dict[str, Any]]] = {p[0]: [] for p in plans}
    for i in range(rounds):
        # ABBA order: whatever runs first in a round (warmer caches, another
        # process's burst) favours each plan equally often
        for label, port, path, bodies, conc, n, pids in (plans if i % 2 == 0 else plans[::-1]):
            got[label].append(gen.run(port, bodies, conc, dur, n, pids=pids, path=path))
    out = {}
    for label, rs in got.items():
        cpu = {k: median([r["cpu_ms_per_request"].get(k, 0.0) for r in rs])
               for k in rs[0]["cpu_ms_per_request"]}
        out[label] = {"rps": median([r["rps"] for r in rs]),
                      "texts_per_s": median([r["texts_per_s"] for r in rs]),
                      "p50_ms": median([r["p50_ms"] for r in rs]),
                      "p99_ms": median([r["p99_ms"] for r in rs]),
                      "errors": sum(r["errors"] for r in rs),
                      "requests": sum(r["requests"] for r in rs),
                      "cpu_ms_per_request": cpu, "rounds": [r["rps"] for r in rs]}
    return out


def ecosystem_runs(gen: LoadGen, svc: Any, workdir: str, models_dir: str, texts: list[str],
                   single: str, batched: str, dur: float, warm: float,
                   rounds: int) -> dict[str, Any]:
    """OIP JSON infer vs /predict on `svc`, and the metrics overhead: two fresh
    services alike but for metrics.enabled, interleaved runs."""
    from tests.helpers import wait_for

    oip_single = write_bodies(os.path.join(workdir, "oip-single.jsonl"),
                              [_oip_body([t]) for t in texts[:2000]])
    oip_batch = write_bodies(os.path.join(workdir, "oip-batch.jsonl"),
                             [_oip_body([texts[(i * BATCH_TEXTS + j) % len(texts)]
                                         for j in range(BATCH_TEXTS)]) for i in range(40)])
    on = {"supervisor": svc.proc.pid}
    res: dict[str, Any] = {}
    log(f"OIP infer vs /predict, {rounds} interleaved rounds ...")
    res["oip"] = _alternate(gen, [
        ("predict_c64", svc.port, "/predict", single, CONC_THROUGHPUT, 1, on),
        ("oip_c64", svc.port, OIP_PATH, oip_single, CONC_THROUGHPUT, 1, on),
        ("predict_b256", svc.port, "/predict", batched, CONC_BATCH, BATCH_TEXTS, on),
        ("oip_b256", svc.port, OIP_PATH, oip_batch, CONC_BATCH, BATCH_TEXTS, on),
    ], dur, warm, rounds)
    for k, r in res["oip"].items():
        log(f"  {k}: {r['rps']:.1f} req/s, {r['texts_per_s']:.0f} texts/s, errors {r['errors']}")

    # the counting call itself, timed in this process: a figure that the noise
    # of a shared machine cannot hide (req/s of two services can differ by more)
    import timeit

    from control.metrics import Metrics
    counter = Metrics(None, enabled=True)
    calls = 200_000
    res["observe_request_us"] = 1e6 * timeit.timeit(
        lambda: counter.observe_request("predict", MODEL, 1, 200, 0.012), number=calls) / calls
    # two fresh services, alike but for metrics.enabled, each on its own copy of
    # the store (the warm one above has served other load: not a fair pair)
    log("metrics on vs off: two fresh services, each on a copy of the store ...")
    pair = {}
    try:
        for tag, enabled in (("metrics-on", True), ("metrics-off", False)):
            d = os.path.join(workdir, f"models-{tag}")
            shutil.copytree(models_dir, d, ignore=shutil.ignore_patterns(".state.db*", ".tmp"))
            pair[tag] = start_service(workdir, d, standby=True, tag=tag, metrics=enabled)
        for p in pair.values():
            wait_for(lambda: p.status()["serving"], 180, "the startup apply", interval=0.2)
            p.wait_standby(180)
        on_svc, off = pair["metrics-on"], pair["metrics-off"]
        assert off.mget("/metrics")[0] == 404 and on_svc.mget("/metrics")[0] == 200
        res["metrics"] = _alternate(gen, [
            ("on_c64", on_svc.port, "/predict", single, CONC_THROUGHPUT, 1,
             {"supervisor": on_svc.proc.pid}),
            ("off_c64", off.port, "/predict", single, CONC_THROUGHPUT, 1,
             {"supervisor": off.proc.pid}),
        ], dur, warm, rounds)
        code, text = on_svc.mget("/metrics")
        res["scrape_bytes"] = len(text) if isinstance(text, (bytes, str)) else None
    finally:
        for p in pair.values():
            p.stop()
    m = res["metrics"]
    log(f"  metrics on {m['on_c64']['rps']:.0f} req/s vs off {m['off_c64']['rps']:.0f} req/s "
        f"(rounds on {[round(x) for x in m['on_c64']['rounds']]}, "
        f"off {[round(x) for x in m['off_c64']['rounds']]})")
    return res


def print_ecosystem(eco: dict[str, Any]) -> None:
    print(f"\n{'ecosystem (medians of interleaved runs)':<40}{'conc':>5}{'req/s':>10}"
          f"{'texts/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}  supervisor CPU ms/request")
    rows = [("POST /predict, 1 text", eco["oip"]["predict_c64"], CONC_THROUGHPUT),
            ("OIP infer (JSON), 1 text", eco["oip"]["oip_c64"], CONC_THROUGHPUT),
            (f"POST /predict, {BATCH_TEXTS} texts", eco["oip"]["predict_b256"], CONC_BATCH),
            (f"OIP infer (JSON), {BATCH_TEXTS} texts", eco["oip"]["oip_b256"], CONC_BATCH),
            ("/predict, metrics on", eco["metrics"]["on_c64"], CONC_THROUGHPUT),
            ("/predict, metrics off", eco["metrics"]["off_c64"], CONC_THROUGHPUT)]
    for label, r, conc in rows:
        print(f"{label:<40}{conc:>5}{r['rps']:>10.1f}{r['texts_per_s']:>10.0f}"
              f"{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['errors']:>8}  "
              f"{r['cpu_ms_per_request'].get('supervisor', 0):.3f}")
    o, m = eco["oip"], eco["metrics"]
    print(f"OIP / /predict: {o['oip_c64']['rps'] / o['predict_c64']['rps']:.2f} (1 text), "
          f"{o['oip_b256']['texts_per_s'] / o['predict_b256']['texts_per_s']:.2f} "
          f"({BATCH_TEXTS} texts); metrics on / off: "
          f"{m['on_c64']['rps'] / m['off_c64']['rps']:.3f} req/s, supervisor CPU per request "
          f"{m['on_c64']['cpu_ms_per_request']['supervisor'] / m['off_c64']['cpu_ms_per_request']['supervisor']:.3f}")
    us = eco.get("observe_request_us")
    if us is not None:
        sup = m["off_c64"]["cpu_ms_per_request"]["supervisor"] * 1000
        print(f"counting one request (timed in-process): {us:.2f} us = {100 * us / sup:.2f}% of "
              f"the supervisor's {sup:.0f} us of CPU per request")


def run_ecosystem(args: argparse.Namespace) -> int:
    """Only the ecosystem section (`--ecosystem`): set-up, then metrics and OIP runs."""
    dur = 3.0 if args.quick else 8.0
    warm = 1.0 if args.quick else 2.0
    kind = args.loadgen or ("wrk" if shutil.which("wrk") else "python")
    workdir = tempfile.mkdtemp(prefix="textswap-bench-")
    gen = LoadGen(kind, workdir)
    texts = read_texts()
    single = write_bodies(os.path.join(workdir, "single.jsonl"),
                          [{"text": t} for t in texts[:2000]])
    batched = write_bodies(os.path.join(workdir, "batch.jsonl"),
                           [{"texts": [texts[(i * BATCH_TEXTS + j) % len(texts)]
                                       for j in range(BATCH_TEXTS)]} for i in range(40)])
    models_dir, train = prepare_models(workdir, reuse=True)
    svc = start_service(workdir, models_dir, standby=True, tag="warm")
    try:
        from tests.helpers import wait_for
        if train:
            log("training the demo model (first run; later runs reuse bench/.cache) ...")
            wait_for(lambda: svc.status()["serving"], 900, "the demo model", interval=1.0)
            code, body = svc.mpost("/train", {"name": MODEL, "data": {"path": DATA_REL},
                                              "params": V2_PARAMS, "apply": False})
            assert code == 202, body
            wait_models(svc, 900)
            save_cache(models_dir)
        wait_for(lambda: svc.status()["serving"], 180, "the startup apply", interval=0.2)
        svc.wait_standby(180)
        eco = ecosystem_runs(gen, svc, workdir, models_dir, texts, single, batched, dur, warm,
                             args.rounds)
    finally:
        svc.stop()
    res = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadgen": kind,
           "machine": {"cpus": os.cpu_count()}, "durations_s": {"measure": dur},
           "ecosystem": eco}
    res["targets"] = {"metrics_overhead": _metrics_target(eco)}
    print_ecosystem(eco)
    t = res["targets"]["metrics_overhead"]
    print(f"\n{t['target']:<52}{t['measured']:<42}{t['ratio']:>7.2f}  "
          f"{'PASS' if t['pass'] else 'FAIL'}")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"ecosystem-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if t["pass"] else 1


# ---------------------------------------------------------------------------
# The event loop and JSON (--loops): each change alone, against bare Tornado
# ---------------------------------------------------------------------------

# (label, server.event_loop, TEXTSWAP_JSON, server.http_parser, worker.engine):
# the service as it was (asyncio's loop, the standard library's json,
# Tornado's HTTP server, the model through Keras), each change alone, the
# three of the supervisor together, and with the lean engine too (the default)
LOOP_VARIANTS = [("asyncio+json+tornado", "asyncio", "stdlib", "tornado", "keras"),
                 ("uvloop+json+tornado", "uvloop", "stdlib", "tornado", "keras"),
                 ("asyncio+orjson+tornado", "asyncio", "", "tornado", "keras"),
                 ("asyncio+json+httptools", "asyncio", "stdlib", "httptools", "keras"),
                 ("uvloop+orjson+httptools", "uvloop", "", "httptools", "keras"),
                 ("all three + lean engine", "uvloop", "", "httptools", "lean")]
BEFORE, DEFAULT = LOOP_VARIANTS[0][0], LOOP_VARIANTS[-1][0]


def json_timings() -> dict[str, dict[str, float]]:
    """The request path's JSON calls timed in this process, stdlib vs jsonwire
    (microseconds, best of 5): figures that a shared machine's noise cannot hide."""
    import timeit

    from frontend import jsonwire

    texts = read_texts(BATCH_TEXTS)
    m = {"name": MODEL, "version": 2, "labels": ["负面", "正面"], "replicas": 1}

    def pred(i: int) -> dict[str, Any]:
        s = 0.93 + i * 1e-4
        return {"label": "正面", "score": s,
                "top": [{"label": "正面", "score": s}, {"label": "负面", "score": 1 - s}]}

    cases: list[tuple[str, Any, Any, int]] = []
    for n, body in ((1, {"text": texts[0]}), (BATCH_TEXTS, {"texts": texts})):
        raw = json.dumps(body, ensure_ascii=True).encode()  # as the bench's clients send it
        cases.append((f"parse {n} text(s)", lambda raw=raw: json.loads(raw.decode("utf-8")),
                      lambda raw=raw: jsonwire.loads_utf8(raw), 20000 if n == 1 else 300))
    for n in (1, BATCH_TEXTS):
        ans = {"model": m, "predictions": [pred(i) for i in range(n)], "request_id": "r" * 44}
        cases.append((f"render {n} prediction(s)",
                      lambda ans=ans: json.dumps(ans, ensure_ascii=False,
                                                 allow_nan=False).encode(),
                      lambda ans=ans: jsonwire.dumps(ans), 20000 if n == 1 else 300))
    out = {}
    for label, std, ours, number in cases:
        t = {k: 1e6 * min(timeit.repeat(f, number=number, repeat=5)) / number
             for k, f in (("stdlib_us", std), ("orjson_us", ours))}
        out[label] = {**t, "speedup": t["stdlib_us"] / t["orjson_us"]}
    return out


def run_loops(args: argparse.Namespace) -> int:
    """`--loops`: single text at c64 (the log on) and 256 texts at c4, on four
    services alike but for the event loop and the JSON library, against the
    bare Tornado echo on asyncio's default loop; interleaved rounds, medians."""
    from tests.helpers import free_port, wait_for

    dur = 3.0 if args.quick else 8.0
    warm = 1.0 if args.quick else 2.0
    rounds = 1 if args.quick else args.rounds
    kind = args.loadgen or ("wrk" if shutil.which("wrk") else "python")
    workdir = tempfile.mkdtemp(prefix="textswap-bench-")
    gen = LoadGen(kind, workdir)
    texts = read_texts()
    single = write_bodies(os.path.join(workdir, "single.jsonl"),
                          [{"text": t} for t in texts[:2000]])
    batched = write_bodies(os.path.join(workdir, "batch.jsonl"),
                           [{"texts": [texts[(i * BATCH_TEXTS + j) % len(texts)]
                                       for j in range(BATCH_TEXTS)]} for i in range(40)])
    models_dir, train = prepare_models(workdir, reuse=True)
    if train:  # the cache the other modes use: two versions, as the full run trains them
        svc = start_service(workdir, models_dir, standby=False, tag="train")
        try:
            log("training the demo model (first run; later runs reuse bench/.cache) ...")
            wait_for(lambda: svc.status()["serving"], 900, "the demo model", interval=1.0)
            code, body = svc.mpost("/train", {"name": MODEL, "data": {"path": DATA_REL},
                                              "params": V2_PARAMS, "apply": False})
            assert code == 202, body
            wait_models(svc, 900)
            save_cache(models_dir)
        finally:
            svc.stop()
    svcs: dict[str, Any] = {}
    eport = free_port()
    echo = subprocess.Popen([sys.executable, "-m", "bench.serving", "--echo-server",
                             str(eport)], cwd=ROOT)
    res: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadgen": kind,
                           "machine": {"cpus": os.cpu_count()},
                           "durations_s": {"measure": dur, "rounds": rounds}}
    try:
        for label, loop_kind, json_env, parser, engine in LOOP_VARIANTS:
            d = os.path.join(workdir, f"models-{label}")
            shutil.copytree(models_dir, d, ignore=shutil.ignore_patterns(".state.db*", ".tmp"))
            env = {"TEXTSWAP_JSON": json_env} if json_env else {}
            svcs[label] = s = start_service(workdir, d, standby=False, tag=label,
                                            server={"event_loop": loop_kind,
                                                    "http_parser": parser}, env=env, engine=engine)
            wait_for(lambda: s.status()["serving"], 300, f"{label}: the startup apply",
                     interval=0.2)
        wait_for(lambda: _port_open(eport), 20, "echo server")
        log(f"single text at c{CONC_THROUGHPUT}, {rounds} interleaved rounds of {dur:.0f} s ...")
        plans = [("echo", eport, "/predict", single, CONC_THROUGHPUT, 1, {"server": echo.pid})]
        plans += [(label, s.port, "/predict", single, CONC_THROUGHPUT, 1,
                   {"server": s.proc.pid}) for label, s in svcs.items()]
        res["single_c64"] = _alternate(gen, plans, dur, warm, rounds)
        log(f"{BATCH_TEXTS} texts at c{CONC_BATCH} ...")
        bplans = [(label, s.port, "/predict", batched, CONC_BATCH, BATCH_TEXTS,
                   {"server": s.proc.pid}) for label, s in svcs.items()]
        res["batch_c4"] = _alternate(gen, bplans, max(dur, 8.0), warm, rounds)
    finally:
        echo.terminate()
        echo.wait(10)
        for s in svcs.values():
            s.stop()
    res["json_us"] = json_timings()
    print_loops(res)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"loops-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(t["pass"] for t in res["targets"].values()) else 1


def print_loops(res: dict[str, Any]) -> None:
    one, batch = res["single_c64"], res["batch_c4"]
    echo = one["echo"]
    # server CPU per request (the supervisor's, or the echo process's): the
    # figure a shared machine's noise hides least; req/s swings with the load
    def cpu(r: dict[str, Any]) -> float:
        return float(r["cpu_ms_per_request"].get("server", 0.0))

    print(f"\n{'loop, JSON, HTTP (medians)':<34}{'req/s c64':>10}{'/ echo':>7}"
          f"{'CPU ms/req':>11}{'echo/this':>10}{'texts/s b256':>13}{'/ before':>9}"
          f"{'CPU ms/req':>11}{'/ before':>9}  rounds c64 (req/s)")
    print(f"{'bare tornado echo (asyncio)':<34}{echo['rps']:>10.0f}{1.0:>7.2f}"
          f"{cpu(echo):>11.3f}{1.0:>10.2f}{'':>13}{'':>9}{'':>11}{'':>9}  "
          f"{[round(x) for x in echo['rounds']]}")
    before = batch[BEFORE]["texts_per_s"]
    bcpu = cpu(batch[BEFORE])
    for label, *_ in LOOP_VARIANTS:
        r, b = one[label], batch[label]
        print(f"{'service, ' + label:<34}{r['rps']:>10.0f}{r['rps'] / echo['rps']:>7.2f}"
              f"{cpu(r):>11.3f}{cpu(echo) / max(cpu(r), 1e-9):>10.2f}{b['texts_per_s']:>13.0f}"
              f"{b['texts_per_s'] / before:>9.2f}{cpu(b):>11.3f}{cpu(b) / max(bcpu, 1e-9):>9.2f}"
              f"  {[round(x) for x in r['rounds']]}")
    print("\nJSON calls in-process (us, best of 5):")
    for label, t in res["json_us"].items():
        print(f"  {label:<26} stdlib {t['stdlib_us']:>9.1f}   orjson {t['orjson_us']:>9.1f}"
              f"   {t['speedup']:.1f}x")
    new, old = one[DEFAULT]["rps"], one[BEFORE]["rps"]
    b_ratio = batch[DEFAULT]["texts_per_s"] / before
    errors = sum(x["errors"] for x in (*one.values(), *batch.values()))
    res["targets"] = {
        "single_vs_echo": {"target": ">= 1.1x bare Tornado req/s, 1 text, c64, log on",
                           "measured": f"{new:.0f} vs {echo['rps']:.0f} (before "
                                       f"{old / echo['rps']:.2f}x)",
                           "ratio": round(new / echo["rps"], 3),
                           "pass": new / echo["rps"] >= 1.1},
        "batch_vs_before": {"target": "256 texts/request: no slower than before",
                            "measured": f"{batch[DEFAULT]['texts_per_s']:.0f} vs "
                                        f"{before:.0f} texts/s", "ratio": round(b_ratio, 3),
                            "pass": b_ratio >= 0.97},
        "single_cpu_vs_echo": {
            "target": ">= 1.1x bare Tornado, as CPU: echo's ms/req / ours",
            "measured": f"{cpu(one[DEFAULT]):.3f} vs {cpu(echo):.3f} ms (before "
                        f"{cpu(echo) / max(cpu(one[BEFORE]), 1e-9):.2f}x)",
            "ratio": round(cpu(echo) / max(cpu(one[DEFAULT]), 1e-9), 3),
            "pass": cpu(echo) / max(cpu(one[DEFAULT]), 1e-9) >= 1.1},
        "batch_cpu_vs_before": {
            "target": "256 texts/request: CPU ms/request <= before",
            "measured": f"{cpu(batch[DEFAULT]):.2f} vs {bcpu:.2f} ms",
            "ratio": round(cpu(batch[DEFAULT]) / max(bcpu, 1e-9), 3),
            "pass": cpu(batch[DEFAULT]) <= bcpu},
        "errors": {"target": "no failed requests", "measured": str(errors), "ratio": None,
                   "pass": errors == 0}}
    print(f"\n{'target':<52}{'measured':<42}{'ratio':>7}  result")
    for t in res["targets"].values():
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        print(f"{t['target']:<52}{t['measured']:<42}{ratio:>7}  "
              f"{'PASS' if t['pass'] else 'FAIL'}")


def _metrics_target(eco: dict[str, Any]) -> dict[str, Any]:
    on, off = eco["metrics"]["on_c64"], eco["metrics"]["off_c64"]
    r = on["rps"] / off["rps"]
    return {"target": TARGETS["metrics_overhead"],
            "measured": f"{on['rps']:.0f} vs {off['rps']:.0f} req/s", "ratio": round(r, 3),
            "pass": r >= 0.97 and on["errors"] == 0 and off["errors"] == 0}


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def evaluate(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    runs = res["runs"]
    out: dict[str, dict[str, Any]] = {}

    def target(key: str, measured: str, ratio: float | None, ok: bool) -> None:
        out[key] = {"target": TARGETS[key], "measured": measured,
                    "ratio": None if ratio is None else round(ratio, 3), "pass": bool(ok)}

    s64, e64 = runs[f"single_c{CONC_THROUGHPUT}"], runs[f"echo_c{CONC_THROUGHPUT}"]
    r = s64["rps"] / e64["rps"]
    target("single_rps", f"{s64['rps']:.0f} vs {e64['rps']:.0f} req/s", r,
           r >= 0.8 and s64["errors"] == 0)
    s8, e8 = runs[f"single_c{CONC_LATENCY}"], runs[f"echo_c{CONC_LATENCY}"]
    r = s8["p99_ms"] / e8["p99_ms"]
    target("single_p99", f"{s8['p99_ms']:.1f} vs {e8['p99_ms']:.1f} ms", r,
           r <= 2.0 and s8["errors"] == 0)
    b, ip = runs[f"batch_c{CONC_BATCH}"], runs["inprocess_b256"]
    r = b["texts_per_s"] / ip["texts_per_s"]
    target("batch_tps", f"{b['texts_per_s']:.0f} vs {ip['texts_per_s']:.0f} texts/s", r,
           r >= 0.5 and b["errors"] == 0 and b["requests"] > 0)
    warm = median([a["to_serving_s"] for a in res["applies_warm"]])
    target("apply_warm", "none served" if warm is None else
           f"median {warm:.3f} s of {len(res['applies_warm'])}", warm,
           warm is not None and warm <= 1.0)
    cold = [a["to_serving_s"] for a in res["applies_cold"]]
    cm = median(cold)
    target("apply_cold", "failed" if cm is None else
           f"median {cm:.2f} s of {len(cold)}", cm,
           bool(cold) and all(c is not None for c in cold))
    sw = res["swap"]
    target("swap_dip", f"{sw['around_rps']:.0f} vs {sw['steady_rps']:.0f} req/s "
           f"(worst 0.5 s {sw['worst_500ms_rps']:.0f})", sw["dip"],
           sw["dip"] is not None and sw["dip"] <= 0.20)
    errs = runs[f"swap_c{CONC_SWAP}"]["errors"]
    target("swap_errors", f"{errs} errors of {runs[f'swap_c{CONC_SWAP}']['requests']}", None,
           errs == 0)
    out["metrics_overhead"] = _metrics_target(res["ecosystem"])
    mem = res["memory"]["supervisor_rss_peak"]
    target("sup_rss", f"{mem / 2**20:.1f} MB peak (worker "
           f"{(res['memory']['worker_rss_now'] or 0) / 2**20:.0f} MB)", mem / (80 * 2**20),
           mem < 80 * 2**20)
    return out


def print_report(res: dict[str, Any]) -> None:
    runs = res["runs"]
    print(f"\n== textswap serving bench: {res['machine']['cpus']} CPUs, load generator "
          f"{res['loadgen']} (shares the CPUs), {res['durations_s']['measure']:.0f} s per run")
    print(f"{'setup':<26}{'conc':>5}{'req/s':>10}{'texts/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'errors':>8}  server CPU ms/request")
    rows = [("bare tornado echo", f"echo_c{CONC_THROUGHPUT}", CONC_THROUGHPUT),
            ("bare tornado echo", f"echo_c{CONC_LATENCY}", CONC_LATENCY),
            ("service, 1 text", f"single_c{CONC_THROUGHPUT}", CONC_THROUGHPUT),
            ("service, 1 text", f"single_c{CONC_LATENCY}", CONC_LATENCY),
            (f"in-process model, b{BATCH_TEXTS}", "inprocess_b256", 1),  # p50: ms per call
            (f"service, {BATCH_TEXTS} texts", f"batch_c{CONC_BATCH}", CONC_BATCH),
            ("service during swap", f"swap_c{CONC_SWAP}", CONC_SWAP)]
    for label, key, conc in rows:
        r = runs.get(key)
        if not r:
            continue
        p99 = r.get("p99_ms")
        rps = f"{r['rps']:.0f}" if r["rps"] >= 100 else f"{r['rps']:.2f}"
        print(f"{label:<26}{conc:>5}{rps:>10}{r['texts_per_s']:>10.0f}"
              f"{r['p50_ms']:>9.1f}{'-' if p99 is None else f'{p99:.1f}':>9}{r['errors']:>8}  "
              + ", ".join(f"{k} {v:.2f}" for k, v in r.get("cpu_ms_per_request", {}).items()))
    print("\napplies (call -> /predict answers from the new version):")
    for kind in ("warm", "cold"):
        for a in res[f"applies_{kind}"]:
            ph = a["phases_s"]
            print(f"  {kind:<5} -> v{a['version']}: serving {a['to_serving_s']:.3f} s, "
                  f"apply answered {a['http_s']:.3f} s (spawn {ph.get('spawn', 0):.3f}, "
                  f"load {ph.get('load', 0):.3f}, drain {ph.get('drain', 0):.3f}, "
                  f"stop {ph.get('stop', 0):.3f})")
    sw = res["swap"]
    a = sw["apply"]
    print(f"swap under load: apply -> serving {a['to_serving_s']:.3f} s; req/s steady "
          f"{sw['steady_rps']:.0f}, call..+{sw['window_s'][1]:.1f}s {sw['around_rps']:.0f}, "
          f"next 4 s {sw['after_rps']:.0f}, worst 0.5 s {sw['worst_500ms_rps']:.0f}")
    m = res["memory"]
    print(f"memory: supervisor RSS peak {m['supervisor_rss_peak'] / 2**20:.1f} MB; serving "
          f"worker RSS {(m['worker_rss_now'] or 0) / 2**20:.0f} MB "
          f"(peak of any child {(m['worker_rss_peak'] or 0) / 2**20:.0f} MB)")
    print_ecosystem(res["ecosystem"])
    print(f"\n{'target':<52}{'measured':<42}{'ratio':>7}  result")
    for t in res["targets"].values():
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        print(f"{t['target']:<52}{t['measured']:<42}{ratio:>7}  "
              f"{'PASS' if t['pass'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="short smoke run (reuses cached models when present)")
    p.add_argument("--reuse-models", action="store_true",
                   help="use the models trained by an earlier run (bench/.cache)")
    p.add_argument("--loadgen", choices=("wrk", "python"), help="default: wrk when installed")
    p.add_argument("--profile", action="store_true",
                   help="also record py-spy profiles of the supervisor and worker under load")
    p.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    p.add_argument("--ecosystem", action="store_true",
                   help="only the ecosystem section: metrics on vs off, OIP vs /predict")
    p.add_argument("--loops", action="store_true",
                   help="only the event loop and JSON section: uvloop and orjson, each alone "
                        "and both, vs the bare Tornado echo")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of each ecosystem run (medians; default 3)")
    p.add_argument("--echo-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-speed", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--loadgen-client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.echo_server:
        echo_server(args.echo_server)
        return 0
    if args.model_speed:
        model_speed(args.model_speed, args.seconds)
        return 0
    if args.loadgen_client:
        loadgen(json.loads(args.loadgen_client))
        return 0
    if args.ecosystem:
        return run_ecosystem(args)
    if args.loops:
        return run_loops(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
