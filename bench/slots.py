"""Model slots benchmark: two models at once, swaps beside load, replica
crashes, recovery with no standby, and worker recycling.

    .venv/bin/python -m bench.slots            # full run, under 10 minutes
    .venv/bin/python -m bench.slots --quick    # short smoke run
    make bench-slots

Runs the real service (python supervisor.py) on free ports with the tiny
real models of tests/tinymodels.py (sent v1, sent v2, topic v1), on
127.0.0.1 only. Each figure is printed beside a baseline taken in the same
run, so the ratios mean something on a busy machine:

  1. single-text requests/s with the load split over two models vs. the
     same load on one model (c64; the load generator of bench/serving.py)
  2. topic's p50/p99 while sent (also under load) is swapped back and forth
     vs. the same two loads with no swap
  3. 2 replicas of sent under c16: a burst of applies, then kill -9 of one
     replica: failed requests, requests over 2 s, max latency, time until
     the replacement serves; repeated
  4. kill -9 of the only replica with no standby (worker.standby false):
     the longest time no request was answered, vs. the same kill with a
     ready standby
  6. cold apply: unload a model, then apply it again (a new worker loads
     it), with a ready standby and with none; target median <= 1.5 s
  7. 40 models (copies of sent v1) applied at once, 1 replica each, no
     standby: all answer; mean PSS of their workers (target <= 80 MB) and
     PSS of the whole service (target <= 4 GB)
  5. worker.max_requests recycling under long load: failed requests and
     recycles; and the RSS of one worker over a long run without recycling
     (drift per 100k requests)

Results: a table on stdout and JSON in bench/results/. Exit 1 when a hard
guarantee fails (a failed request, a request over 2 s with 2 replicas, no
recycle), not for timing ratios.
"""
from __future__ import annotations

import argparse
import http.client
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

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.serving import CONC_THROUGHPUT, LoadGen, log, read_texts, write_bodies  # noqa: E402
from tests.helpers import Service, pid_gone, request, wait_for  # noqa: E402

CACHE = os.path.join(ROOT, "bench", ".cache", "tiny-models")
RESULTS = os.path.join(ROOT, "bench", "results")
CONC_CRASH = 16   # the steady load
CONC_SIDE = 8     # each model's load while the other swaps
SLOW_S = 2.0


# ---------------------------------------------------------------------------
# Per-request recording client (the crash figures need every request)
# ---------------------------------------------------------------------------

class Recorder:
    """Closed-loop client threads, one request at a time each, keeping every
    request's end time, latency and status (0: no HTTP answer). Requests over
    2 s and the longest silence after a kill are what a percentile summary
    hides."""

    def __init__(self, port: int, body: dict[str, Any], conc: int) -> None:
        self.port, self.body = port, body
        self.done: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(conc)]

    def _run(self) -> None:
        deadline = time.monotonic() + 1800  # hard bound
        while not self._stop.is_set() and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                code, _ = request(self.port, "POST", "/predict", self.body, timeout=60)
            except (OSError, http.client.HTTPException):
                code = 0
            t1 = time.monotonic()
            self.done.append((t1, t1 - t0, code))

    def answered(self, n: int, timeout: float = 60) -> None:
        """Wait until n more requests were answered."""
        k = len(self.done)
        wait_for(lambda: len(self.done) >= k + n, timeout, f"{n} more answers")

    def __enter__(self) -> "Recorder":
        for t in self._threads:
            t.start()
        self.answered(50)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def outcome(recs: list[tuple[float, float, int]], since: float | None = None
            ) -> dict[str, Any]:
    """Failed, over 2 s, max latency; with `since`, the longest silence after it
    (from `since` to the first answer, or between two answers)."""
    out: dict[str, Any] = {
        "requests": len(recs), "failed": sum(1 for r in recs if r[2] != 200),
        "over_2s": sum(1 for r in recs if r[1] > SLOW_S),
        "max_latency_s": round(max((r[1] for r in recs), default=0.0), 3)}
    if since is not None:
        ends = sorted(r[0] for r in recs if r[0] >= since and r[2] == 200)
        gaps = [b - a for a, b in zip([since] + ends, ends)]
        out["longest_silence_s"] = round(max(gaps, default=float("nan")), 3)
    return out


# ---------------------------------------------------------------------------
# The service and its models
# ---------------------------------------------------------------------------

def tiny_store(workdir: str) -> str:
    """A copy of the tiny models (built once into bench/.cache; TensorFlow
    runs in a child process, never in this one)."""
    if not os.path.isdir(os.path.join(CACHE, "topic")):
        log("building tiny models (tests/tinymodels.py) ...")
        tmp = CACHE + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tinymodels.py"), tmp],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        shutil.rmtree(CACHE, ignore_errors=True)
        os.rename(tmp, CACHE)
    dst = os.path.join(workdir, f"models-{len(os.listdir(workdir))}")
    shutil.copytree(CACHE, dst)
    return dst


def start(workdir: str, tag: str, worker: dict[str, Any], copies: int = 0) -> Service:
    import yaml

    cfg = os.path.join(workdir, f"config-{tag}.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"worker": worker, "watcher": {"enabled": False}}, fh)
    log(f"starting service {tag} (worker settings {worker or 'default'})")
    store = tiny_store(workdir)
    for i in range(copies):  # m00, m01, ...: sent v1 under other names
        shutil.copytree(os.path.join(store, "sent", "1"), os.path.join(store, f"m{i:02d}", "1"))
    return Service(store, args=["--config", cfg],
                   log_path=os.path.join(workdir, f"service-{tag}.log"))


def apply(svc: Service, name: str, version: int, **kw: Any) -> dict[str, Any]:
    code, body = svc.mpost("/apply", {"name": name, "version": version, **kw}, timeout=180)
    if code != 200:
        raise SystemExit(f"apply {name} v{version} {kw} failed: {code} {body}")
    return body


def slot_workers(svc: Service, name: str) -> list[dict[str, Any]]:
    return (svc.status()["models"].get(name) or {}).get("workers", [])


def kill_and_wait(svc: Service, name: str, rec: Recorder, want: int) -> dict[str, Any]:
    """kill -9 one replica of `name` under the recorder's load; time until a
    replacement serves (the slot has `want` replicas again, the victim gone)
    and the longest silence after the kill."""
    victim = slot_workers(svc, name)[0]["pid"]
    k = len(rec.done)
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        pids = [w["pid"] for w in slot_workers(svc, name)]
        return len(pids) >= want and victim not in pids
    wait_for(replaced, 180, f"a replacement replica of {name}", interval=0.1)
    t_repl = time.monotonic() - t_kill
    rec.answered(50)
    wait_for(lambda: pid_gone(victim), 30, "the killed worker to be reaped")
    after = outcome(rec.done[k:], since=t_kill)
    return {"replacement_serves_s": round(t_repl, 3), **after}


def side_load(gen: LoadGen, svc: Service, bodies: dict[str, str], seconds: float,
              swap: bool) -> dict[str, Any]:
    """topic and sent under load at once; with `swap`, sent is applied back
    and forth (each apply once the pool has a booted standby) meanwhile."""
    procs = {m: gen.start(svc.port, bodies[m], CONC_SIDE, seconds) for m in ("topic", "sent")}
    t_end = time.monotonic() + seconds
    applies = []
    if swap:
        time.sleep(min(2.0, seconds / 5))
        while time.monotonic() < t_end - 2.0:
            svc.wait_standby(180)
            if time.monotonic() > t_end - 2.0:
                break
            version = 2 if svc.status()["models"]["sent"]["version"] == 1 else 1
            body = apply(svc, "sent", version)
            applies.append({"version": version, "preloaded": body["preloaded"],
                            "total_s": body["total_s"]})
    res = {m: LoadGen.result(p, seconds, 1) for m, p in procs.items()}
    return {"topic": res["topic"], "sent": res["sent"], "applies": applies}


# ---------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------

def two_models(gen: LoadGen, svc: Service, bodies: dict[str, str], dur: float, rounds: int
               ) -> dict[str, Any]:
    # CPU per request of each process: on a shared machine two busy workers
    # also win a bigger share of the CPUs than one, which req/s alone hides
    pids = {"supervisor": svc.proc.pid,
            **{m: slot_workers(svc, m)[0]["pid"] for m in ("sent", "topic")}}
    gen.run(svc.port, bodies["both"], CONC_THROUGHPUT, 2.0)  # warm both
    runs: dict[str, list] = {"one": [], "two": []}
    for i in range(rounds):  # ABBA: drift of the machine's load hits both alike
        for key in (("one", "two") if i % 2 == 0 else ("two", "one")):
            r = gen.run(svc.port, bodies["sent" if key == "one" else "both"], CONC_THROUGHPUT,
                        dur, pids=pids)
            runs[key].append(r)
            log(f"  {key} model(s): {r['rps']:.0f} req/s, p99 {r['p99_ms']:.1f} ms, "
                f"errors {r['errors']}, CPU ms/request " + ", ".join(
                    f"{k} {v:.2f}" for k, v in r["cpu_ms_per_request"].items()))
    one = statistics.fmean(r["rps"] for r in runs["one"])
    two = statistics.fmean(r["rps"] for r in runs["two"])
    cpu = {key: {k: statistics.fmean(r["cpu_ms_per_request"].get(k, 0.0) for r in rs)
                 for k in pids} for key, rs in runs.items()}
    return {"one_rps": one, "two_rps": two, "ratio": two / one, "cpu_ms_per_request": cpu,
            "errors": sum(r["errors"] for rs in runs.values() for r in rs), "runs": runs}


def swap_latency(gen: LoadGen, svc: Service, bodies: dict[str, str], base_s: float,
                 swap_s: float) -> dict[str, Any]:
    """No swap, swaps, no swap (the baseline is the mean of the two); the swap
    run is longer: each apply waits for a booted standby."""
    base1 = side_load(gen, svc, bodies, base_s, swap=False)
    log(f"  no swap: topic p50 {base1['topic']['p50_ms']:.1f} p99 "
        f"{base1['topic']['p99_ms']:.1f} ms")
    sw = side_load(gen, svc, bodies, swap_s, swap=True)
    log(f"  {len(sw['applies'])} swaps of sent: topic p50 {sw['topic']['p50_ms']:.1f} p99 "
        f"{sw['topic']['p99_ms']:.1f} ms, errors topic {sw['topic']['errors']} "
        f"sent {sw['sent']['errors']}")
    base2 = side_load(gen, svc, bodies, base_s, swap=False)
    log(f"  no swap: topic p50 {base2['topic']['p50_ms']:.1f} p99 "
        f"{base2['topic']['p99_ms']:.1f} ms")
    out: dict[str, Any] = {"swaps": sw["applies"], "runs": [base1, sw, base2]}
    for p in ("p50_ms", "p99_ms", "max_ms"):
        base = statistics.fmean([base1["topic"][p], base2["topic"][p]])
        out[p] = {"no_swap": base, "swaps": sw["topic"][p], "ratio": sw["topic"][p] / base}
    out["errors"] = sum(r[m]["errors"] for r in (base1, sw, base2) for m in ("topic", "sent"))
    return out


def replica_crashes(svc: Service, repeats: int, burst: int) -> dict[str, Any]:
    apply(svc, "sent", 2, replicas=2)
    tries = []
    for i in range(repeats):
        svc.wait_standby(180)
        with Recorder(svc.port, {"text": "很好", "model": "sent"}, CONC_CRASH) as rec:
            steady = outcome(list(rec.done))
            t_burst = time.monotonic()
            versions = [1 if (i + j) % 2 == 0 else 2 for j in range(burst)]
            for v in versions:
                apply(svc, "sent", v, replicas=2)
            burst_s = time.monotonic() - t_burst
            k = kill_and_wait(svc, "sent", rec, want=2)
        whole = outcome(rec.done)
        tries.append({"burst_applies": burst, "burst_s": round(burst_s, 2),
                      "steady_before": steady, "after_kill": k, "whole_run": whole})
        log(f"  try {i + 1}: {burst} applies in {burst_s:.1f}s, kill -9: replacement serves "
            f"after {k['replacement_serves_s']:.2f}s; whole run {whole['requests']} requests, "
            f"{whole['failed']} failed, {whole['over_2s']} over 2 s, max "
            f"{whole['max_latency_s']:.3f}s (steady before: max "
            f"{steady['max_latency_s']:.3f}s)")
    return {"tries": tries,
            "failed": sum(t["whole_run"]["failed"] for t in tries),
            "over_2s": sum(t["whole_run"]["over_2s"] for t in tries),
            "max_latency_s": max(t["whole_run"]["max_latency_s"] for t in tries),
            "replacement_serves_s": [t["after_kill"]["replacement_serves_s"] for t in tries]}


def single_replica_kills(svc: Service, name: str, tries: int, standby: bool
                         ) -> list[dict[str, Any]]:
    out = []
    with Recorder(svc.port, {"text": "很好", "model": name}, CONC_CRASH) as rec:
        for i in range(tries):
            if standby:
                svc.wait_standby(180)
            k = kill_and_wait(svc, name, rec, want=1)
            out.append(k)
            log(f"  kill {i + 1} ({'ready standby' if standby else 'no standby'}): no answer "
                f"for {k['longest_silence_s']:.2f}s, replacement serves after "
                f"{k['replacement_serves_s']:.2f}s, {k['failed']} failed, max latency "
                f"{k['max_latency_s']:.2f}s")
    return out


def pss(pid: int) -> int:
    """Proportional set size: shared pages split among the processes sharing
    them, so the sum over processes is the memory they hold together."""
    try:
        return psutil.Process(pid).memory_full_info().pss
    except psutil.Error:
        return 0


def many_models(svc: Service, n: int) -> dict[str, Any]:
    """n models (copies of sent v1) applied at once, 1 replica each: do all
    answer; PSS of their serving workers and of the whole service."""
    names = [f"m{i:02d}" for i in range(n)]
    codes: dict[str, Any] = {}

    def one(name: str) -> None:
        codes[name] = svc.mpost("/apply", {"name": name, "version": 1, "replicas": 1,
                                           "default": False}, timeout=600)[0]
    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(m,)) for m in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    apply_s = time.monotonic() - t0
    answered = sum(1 for m in names if svc.predict({"text": "很好", "model": m})[0] == 200)
    pids = [w["pid"] for m in names for w in slot_workers(svc, m)]
    worker_pss = [pss(p) for p in pids]
    procs = [svc.proc.pid] + [c.pid for c in svc.children()]
    total = sum(pss(p) for p in procs)
    return {"models": n, "applied": sum(1 for c in codes.values() if c == 200),
            "answered": answered, "apply_all_s": round(apply_s, 2),
            "failed": {m: c for m, c in codes.items() if c != 200},
            "worker_pss_mean_mb": round(statistics.mean(worker_pss) / 2 ** 20, 1)
            if worker_pss else None,
            "worker_pss_max_mb": round(max(worker_pss) / 2 ** 20, 1) if worker_pss else None,
            "service_pss_mb": round(total / 2 ** 20, 1), "processes": len(procs)}


def cold_applies(svc: Service, name: str, tries: int, standby: bool) -> list[float]:
    """Unload, then apply again: the apply's wall time (a new worker loads it)."""
    out = []
    if name not in svc.status()["models"]:
        apply(svc, name, 1, default=False)
    for _ in range(tries):
        code, body = svc.mpost("/unload", {"name": name}, timeout=120)
        if code != 200:
            raise SystemExit(f"unload {name} failed: {code} {body}")
        if standby:
            svc.wait_standby(180)
        t0 = time.monotonic()
        apply(svc, name, 1, default=False)
        out.append(round(time.monotonic() - t0, 3))
        wait_for(lambda: svc.predict({"text": "很好", "model": name})[0] == 200, 60,
                 f"{name} to answer")
    log(f"  cold apply of {name} ({'ready standby' if standby else 'no standby'}): "
        + ", ".join(f"{x:.2f}" for x in out) + " s")
    return out


def worker_info(svc: Service, name: str) -> dict[str, Any]:
    (w,) = slot_workers(svc, name)
    return {k: w[k] for k in ("pid", "rss_bytes", "uss_bytes", "served")}


def rss_drift(gen: LoadGen, svc: Service, bodies: dict[str, str], dur: float
              ) -> dict[str, Any]:
    a = worker_info(svc, "topic")
    r = gen.run(svc.port, bodies["topic"], CONC_THROUGHPUT, dur)
    b = worker_info(svc, "topic")
    assert a["pid"] == b["pid"], "topic's worker changed during the drift run"
    n = b["served"] - a["served"]
    out = {"start": a, "end": b, "requests": n, "errors": r["errors"], "rps": r["rps"],
           "rss_per_100k_mb": (b["rss_bytes"] - a["rss_bytes"]) / 2**20 * 1e5 / max(n, 1),
           "uss_per_100k_mb": (b["uss_bytes"] - a["uss_bytes"]) / 2**20 * 1e5 / max(n, 1)}
    log(f"  topic worker over {n} requests: RSS {a['rss_bytes'] / 2**20:.1f} -> "
        f"{b['rss_bytes'] / 2**20:.1f} MB, USS {a['uss_bytes'] / 2**20:.1f} -> "
        f"{b['uss_bytes'] / 2**20:.1f} MB")
    return out


def recycling(gen: LoadGen, svc: Service, bodies: dict[str, str], dur: float,
              max_requests: int) -> dict[str, Any]:
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # every pid that served sent, in order
        while not stop.wait(0.5):
            try:
                for w in slot_workers(svc, "sent"):
                    if w["pid"] not in seen:
                        seen.append(w["pid"])
            except (OSError, http.client.HTTPException, AssertionError):
                pass
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        r = gen.run(svc.port, bodies["sent"], CONC_THROUGHPUT, dur)
    finally:
        stop.set()
        th.join(10)
    st = svc.status()
    out = {"max_requests": max_requests, "requests": r["requests"], "errors": r["errors"],
           "rps": r["rps"], "p99_ms": r["p99_ms"], "max_ms": r["max_ms"],
           "workers_seen": len(seen), "recycles": max(0, len(seen) - 1),
           "crash_restarts": st["restarts"]}
    log(f"  {r['requests']} requests at {r['rps']:.0f} req/s with max_requests "
        f"{max_requests}: {out['recycles']} recycles, {r['errors']} errors, max latency "
        f"{r['max_ms']:.0f} ms")
    return out


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    q = args.quick
    dur = 4.0 if q else 8.0           # each throughput run
    rounds = 1 if q else 2
    base_s, swap_s = (8.0, 12.0) if q else (15.0, 30.0)  # latency runs without/with swaps
    repeats, burst = (1, 1) if q else (3, 2)
    kills = 2 if q else 3
    drift_s = 15.0 if q else 45.0
    recycle_s = 15.0 if q else 40.0
    cold = 3 if q else 7
    n_models = 40  # the shape, also in --quick: it is the memory figure
    kind = args.loadgen or ("wrk" if shutil.which("wrk") else "python")
    workdir = tempfile.mkdtemp(prefix="textswap-slotsbench-")
    gen = LoadGen(kind, workdir)
    res: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": q, "loadgen": kind,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_start": os.getloadavg()}}
    log(f"textswap slots bench ({'quick' if q else 'full'}); load generator {kind}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; work dir {workdir}")
    texts = read_texts(1000)
    bodies = {m: write_bodies(os.path.join(workdir, f"{m}.jsonl"),
                              [{"text": t, "model": m} for t in texts]) for m in ("sent", "topic")}
    bodies["both"] = write_bodies(os.path.join(workdir, "both.jsonl"),
                                  [{"text": t, "model": ("sent", "topic")[i % 2]}
                                   for i, t in enumerate(texts)])
    ok = True
    t_run = time.monotonic()
    svc = start(workdir, "A", {})
    try:
        apply(svc, "sent", 1)
        apply(svc, "topic", 1, default=False)
        fresh = worker_info(svc, "topic")
        svc.wait_standby(180)

        log("1. two-model throughput vs one model")
        res["two_models"] = tm = two_models(gen, svc, bodies, dur, rounds)
        ok &= tm["errors"] == 0
        log("2. topic's latency while sent swaps vs no swaps")
        res["swap_latency"] = sl = swap_latency(gen, svc, bodies, base_s, swap_s)
        ok &= sl["errors"] == 0 and len(sl["swaps"]) > 0
        log("3. 2 replicas: burst of applies, then kill -9 of one, under c16")
        res["replica_crash"] = rc = replica_crashes(svc, repeats, burst)
        ok &= rc["failed"] == 0 and rc["over_2s"] == 0
        log("5a. RSS of one worker over a long run (no recycling)")
        res["rss_drift"] = rd = rss_drift(gen, svc, bodies, drift_s)
        rd["fresh"] = fresh
        ok &= rd["errors"] == 0
        log("4a. kill -9 of topic's only worker with a ready standby (the baseline)")
        res["kill_standby"] = single_replica_kills(svc, "topic", 1, standby=True)
        log("6a. cold apply (unload, then apply again) with a ready standby")
        res["cold_apply_standby"] = cold_applies(svc, "topic", cold, standby=True)
    finally:
        code = svc.stop()
        ok &= code == 0 and not svc.leftover

    log("4b. kill -9 of the only worker, no standby (worker.standby false)")
    svc = start(workdir, "B", {"standby": False})
    try:
        apply(svc, "sent", 1)
        res["kill_no_standby"] = kn = single_replica_kills(svc, "sent", kills, standby=False)
        ok &= all(k["failed"] == 0 for k in kn)
        log("6b. cold apply (unload, then apply again) with no standby")
        res["cold_apply_no_standby"] = cold_applies(svc, "topic", cold, standby=False)
    finally:
        svc.stop()

    log(f"7. {n_models} models applied at once, 1 replica each, no standby")
    svc = start(workdir, "D", {"standby": False}, copies=n_models)
    try:
        res["many_models"] = mm = many_models(svc, n_models)
        log(f"  {mm['answered']} of {mm['models']} answer; serving worker PSS mean "
            f"{mm['worker_pss_mean_mb']} MB; service PSS {mm['service_pss_mb']} MB "
            f"over {mm['processes']} processes")
        ok &= mm["answered"] == n_models
    finally:
        svc.stop()

    log("5b. recycling: worker.max_requests under long load")
    max_requests = max(1000, int(tm["one_rps"] * recycle_s / 4))
    svc = start(workdir, "C", {"max_requests": max_requests})
    try:
        apply(svc, "sent", 1)
        svc.wait_standby(180)
        res["recycling"] = rr = recycling(gen, svc, bodies, recycle_s, max_requests)
        ok &= rr["errors"] == 0 and rr["recycles"] >= 1 and rr["crash_restarts"] == 0
    finally:
        svc.stop()
    res["seconds"] = round(time.monotonic() - t_run, 1)
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    res["pass"] = bool(ok)
    report(res)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"slots-{time.strftime('%Y%m%d-%H%M%S')}"
                                 f"{'-quick' if q else ''}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def report(res: dict[str, Any]) -> None:
    mb = 2 ** 20
    tm, sl, rc, rd = (res[k] for k in ("two_models", "swap_latency", "replica_crash",
                                       "rss_drift"))
    kb, kn, rr = res["kill_standby"], res["kill_no_standby"], res["recycling"]
    cn, cs, mm = res["cold_apply_no_standby"], res["cold_apply_standby"], res["many_models"]
    steady = max(t["steady_before"]["max_latency_s"] for t in rc["tries"])
    worst = max(k["longest_silence_s"] for k in kn)
    rows = [
        ("two models, req/s (c64, split) vs one", f"{tm['two_rps']:.0f} vs {tm['one_rps']:.0f}",
         f"{tm['ratio']:.2f}"),
        ("  server CPU ms/request, one / two",
         " / ".join(", ".join(f"{k} {v:.2f}" for k, v in tm["cpu_ms_per_request"][key].items()
                              if v) for key in ("one", "two")), "-"),
        *[(f"topic {p[:3]} while sent swaps ({len(sl['swaps'])}x) vs none",
           f"{sl[p]['swaps']:.1f} vs {sl[p]['no_swap']:.1f} ms", f"{sl[p]['ratio']:.2f}")
          for p in ("p50_ms", "p99_ms", "max_ms")],
        ("errors in 1 and 2", str(tm["errors"] + sl["errors"]), "-"),
        (f"2 replicas, {len(rc['tries'])}x (burst + kill -9): failed",
         f"{rc['failed']} of {sum(t['whole_run']['requests'] for t in rc['tries'])}", "-"),
        ("  requests over 2 s / max latency",
         f"{rc['over_2s']} / {rc['max_latency_s']:.3f} s (steady before {steady:.3f} s)",
         f"{rc['max_latency_s'] / max(steady, 1e-9):.2f}"),
        ("  replacement serves after (s)",
         ", ".join(f"{x:.2f}" for x in rc["replacement_serves_s"]), "-"),
        ("1 replica kill -9, no standby: no answer for",
         ", ".join(f"{k['longest_silence_s']:.2f}" for k in kn) + f" s (worst {worst:.2f})",
         f"{worst / max(kb[0]['longest_silence_s'], 1e-9):.1f}"),
        ("  ... with a ready standby (baseline)", f"{kb[0]['longest_silence_s']:.2f} s", "1.0"),
        ("  target: no answer for, no standby", f"<= 2.0 s: worst {worst:.2f} s",
         "met" if worst <= 2.0 else "MISSED"),
        ("cold apply (unload + apply), median",
         f"{statistics.median(cn):.2f} s no standby ({', '.join(f'{x:.2f}' for x in cn)}), "
         f"{statistics.median(cs):.2f} s standby",
         "met" if max(statistics.median(cn), statistics.median(cs)) <= 1.5 else "MISSED"),
        (f"{mm['models']} models at once, 1 replica: answer",
         f"{mm['answered']} of {mm['models']} (all applied in {mm['apply_all_s']:.1f} s)",
         "met" if mm["answered"] == mm["models"] else "MISSED"),
        ("  serving worker PSS, mean (max)",
         f"{mm['worker_pss_mean_mb']:.0f} MB ({mm['worker_pss_max_mb']:.0f}); target <= 80",
         "met" if mm["worker_pss_mean_mb"] <= 80 else "MISSED"),
        ("  service PSS, all processes",
         f"{mm['service_pss_mb'] / 1024:.2f} GB over {mm['processes']} processes; target <= 4",
         "met" if mm["service_pss_mb"] <= 4096 else "MISSED"),
        ("  failed requests (no standby / standby)",
         f"{sum(k['failed'] for k in kn)} / {kb[0]['failed']}", "-"),
        (f"recycling (max_requests {rr['max_requests']}): failed",
         f"{rr['errors']} of {rr['requests']}, {rr['recycles']} recycles, max "
         f"{rr['max_ms']:.0f} ms", "-"),
        ("worker RSS drift per 100k requests",
         f"{rd['rss_per_100k_mb']:+.2f} MB RSS, {rd['uss_per_100k_mb']:+.2f} MB USS", "-"),
        ("  topic worker RSS fresh / start / end",
         f"{rd['fresh']['rss_bytes'] / mb:.0f} / {rd['start']['rss_bytes'] / mb:.0f} / "
         f"{rd['end']['rss_bytes'] / mb:.0f} MB over {rd['requests']} requests", "-"),
    ]
    print_table("slots", res, rows,
                "hard guarantees: 0 failed, 0 over 2 s with 2 replicas, recycles happen")


def print_table(bench: str, res: dict[str, Any], rows: list[tuple[str, str, Any]],
                guarantees: str) -> None:
    """The figures table and the verdict line (shared by the service benches)."""
    m = res["machine"]
    print(f"\n== textswap {bench} bench: {m['cpus']} CPUs, load average "
          f"{m['loadavg_at_start'][0]:.1f} -> {m['loadavg_at_end'][0]:.1f} (shared), "
          f"load generator {res['loadgen']}, {res['seconds']:.0f} s")
    w = max(len(r[0]) for r in rows) + 2
    print(f"{'figure':<{w}}{'measured (vs baseline)':<72}ratio")
    for label, measured, ratio in rows:
        print(f"{label:<{w}}{measured:<71} {ratio}")
    print("\nRESULT:", "PASS" if res["pass"] else "FAIL", f"({guarantees})")


def bench_args(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """--quick, --loadgen, --keep: the options of the service benches."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--loadgen", choices=("wrk", "python"), help="default: wrk when installed")
    p.add_argument("--keep", action="store_true", help="keep the work dir (service logs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(bench_args(__doc__, argv))


if __name__ == "__main__":
    sys.exit(main())
