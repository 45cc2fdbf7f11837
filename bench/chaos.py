"""Chaos check: minutes of steady predict load while the service is swapped
back and forth and its workers are killed. Prints every figure it measures.

    .venv/bin/python -m bench.chaos [--applies 20] [--kills 3] [--threads 4]

Targets only 127.0.0.1; every loop is bounded in count and time.
Passes (exit 0) when: 0 failed requests, every response's score matches the
version it names, no worker process left over, supervisor RSS back to within
10 MB of its level before, and each kill -9 recovered within 2 s.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from tests.helpers import Service, pid_gone, wait_for  # noqa: E402

PROBE = "还不错吧 ok"


class Load:
    def __init__(self, svc: Service, threads: int) -> None:
        self.svc = svc
        self.ok: list[tuple[float, int, int, float]] = []  # (time, version, pid?, score)
        self.failed: list[tuple[float, object]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        deadline = time.monotonic() + 1800  # hard bound
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                code, body = self.svc.predict({"text": PROBE}, timeout=30)
            except OSError as exc:
                self.failed.append((time.monotonic(), repr(exc)))
                continue
            if code == 200:
                self.ok.append((time.monotonic(), body["model"]["version"], 0,
                                body["predictions"][0]["score"]))
            else:
                self.failed.append((time.monotonic(), (code, body)))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *a) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def family_rss(pid: int) -> tuple[int, int]:
    p = psutil.Process(pid)
    kids = p.children(recursive=True)
    return p.memory_info().rss, sum(k.memory_info().rss for k in kids if k.is_running())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--applies", type=int, default=20)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="textswap-chaos-")
    models = os.path.join(work, "models")
    print("building tiny models ...", flush=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tinymodels.py"), models],
                   check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                   stdout=subprocess.DEVNULL)
    svc = Service(models, log_path=os.path.join(work, "service.log"))
    figures: list[tuple[str, str]] = []
    ok = True
    try:
        expected = {}
        for v in (2, 1):
            assert svc.mpost("/apply", {"name": "sent", "version": v})[0] == 200
            expected[v] = svc.predict({"text": PROBE})[1]["predictions"][0]["score"]
        svc.wait_standby(180)
        sup_rss0, kids_rss0 = family_rss(svc.proc.pid)

        # 1. applies back and forth under load
        apply_times, to_serving = [], []
        with Load(svc, args.threads) as load:
            wait_for(lambda: len(load.ok) > 50, 60, "load")
            for i in range(args.applies):
                version = 2 if i % 2 == 0 else 1
                t0 = time.monotonic()
                code, body = svc.mpost("/apply", {"name": "sent", "version": version},
                                       timeout=120)
                if code != 200:
                    print("apply failed:", code, body)
                    ok = False
                    continue
                apply_times.append(time.monotonic() - t0)
                to_serving.append(body["phases_s"]["queued"] + body["phases_s"]["spawn"]
                                  + body["phases_s"]["swap"])
                svc.wait_standby(180)  # what an operator's pace would give it
            n_ok, n_failed = len(load.ok), len(load.failed)
            mismatched = [r for r in load.ok if abs(r[3] - expected[r[1]]) > 1e-5]
        wait_for(lambda: len([w for w in svc.status()["workers"]]) <= 2, 30, "old workers gone")
        st = svc.status()
        keep = {st["serving"]["generation"], (st["standby"] or {}).get("generation")}
        leftover = [w for w in st["workers"] if w["generation"] not in keep]
        sup_rss1, kids_rss1 = family_rss(svc.proc.pid)
        figures += [
            ("applies under load", f"{len(apply_times)} of {args.applies} succeeded"),
            ("apply call, median / max", f"{statistics.median(apply_times):.3f}s / "
                                         f"{max(apply_times):.3f}s"),
            ("apply to serving (spawn+load+swap), median", f"{statistics.median(to_serving):.3f}s"),
            ("requests during applies", f"{n_ok + n_failed} sent, {n_failed} failed"),
            ("responses whose score != their version's", str(len(mismatched))),
            ("workers left besides serving+standby", str(len(leftover))),
            ("supervisor RSS before / after", f"{sup_rss0 / 2**20:.1f} / {sup_rss1 / 2**20:.1f} MB"),
            ("children RSS before / after", f"{kids_rss0 / 2**20:.0f} / {kids_rss1 / 2**20:.0f} MB"),
        ]
        ok &= n_failed == 0 and not mismatched and not leftover
        ok &= sup_rss1 - sup_rss0 < 10 * 2**20

        # 2. kill -9 of the serving worker under load
        recoveries = []
        with Load(svc, args.threads) as load:
            wait_for(lambda: len(load.ok) > 50, 60, "load")
            for _ in range(args.kills):
                svc.wait_standby(180)
                victim = svc.serving()["pid"]
                t0 = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                wait_for(lambda: (svc.serving() or {}).get("pid") not in (None, victim), 60,
                         "replacement")
                n = len(load.ok)
                wait_for(lambda: len(load.ok) > n, 30, "an answer from the replacement")
                recoveries.append(time.monotonic() - t0)
                wait_for(lambda: pid_gone(victim), 10, "victim reaped")
            k_ok, k_failed = len(load.ok), len(load.failed)
        restarts = svc.status()["restarts"]
        figures += [
            ("kill -9 recoveries (to serving again)", ", ".join(f"{r:.2f}s" for r in recoveries)),
            ("requests during kills", f"{k_ok + k_failed} sent, {k_failed} failed"),
            ("restarts counted in /status", str(restarts)),
        ]
        ok &= k_failed == 0 and max(recoveries) < 2.0 and restarts == args.kills
    finally:
        code = svc.stop()
        figures.append(("service exit code / leftover processes",
                        f"{code} / {len(svc.leftover)}"))
        ok &= code == 0 and not svc.leftover
        shutil.rmtree(work, ignore_errors=True)
    width = max(len(k) for k, _ in figures)
    print()
    for k, v in figures:
        print(f"{k:<{width}}  {v}")
    print("\nRESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
