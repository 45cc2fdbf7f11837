"""Serving under a slow disk: does a 200 ms fsync reach the request path?

    python -m bench.faults [--fsync-ms 200] [--seconds 20]

A tiny LD_PRELOAD shim (compiled here with the system C compiler) makes
every fsync/fdatasync of the supervisor process sleep `--fsync-ms` while a
flag file exists: a real slow disk as the process sees it. The workers do
not get it (TEXTSWAP_PRELOAD_SUPERVISOR_ONLY). Client threads send
single-text /predict requests throughout three phases of the same run:

  idle     no changes of serving state
  fast     an apply every 0.5 s (v1 and v2 in turn, the other one kept
           in probation: each apply is the record write and the swap)
  slow     the same, every fsync taking --fsync-ms

and the table gives each phase's p50/p99 and the ratios to `idle`, with
the apply/rollback times. Record writes run in a writer thread, so the
slow phase's p99 should stay near the fast phase's while the applies and
applies themselves take the fsync time longer (they persist, then
switch, then answer).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tests.helpers import Service  # noqa: E402

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>
static void slow(void) {
    const char *flag = getenv("SLOWDISK_FLAG");
    const char *ms = getenv("SLOWDISK_MS");
    if (flag && ms && access(flag, F_OK) == 0) usleep(1000 * atoi(ms));
}
int fsync(int fd) {
    static int (*real)(int) = 0;
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    slow();
    return real(fd);
}
int fdatasync(int fd) {
    static int (*real)(int) = 0;
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    slow();
    return real(fd);
}
"""


def build_shim(folder: str) -> str:
    src, lib = os.path.join(folder, "slowdisk.c"), os.path.join(folder, "slowdisk.so")
    with open(src, "w") as fh:
        fh.write(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], check=True)
    return lib


class Load:
    def __init__(self, svc: Service, threads: int) -> None:
        self.svc, self.stop = svc, threading.Event()
        self.samples: list[tuple[float, float, int]] = []  # (start, latency, status)
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            code, _ = self.svc.predict({"text": "很好", "model": "sent"}, timeout=60)
            self.samples.append((t0, time.monotonic() - t0, code))

    def between(self, a: float, b: float) -> list[float]:
        return [lat for t0, lat, _ in self.samples if a <= t0 < b]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsync-ms", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-faults-")
    try:
        lib = build_shim(work)
        store = os.path.join(work, "models")
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tinymodels.py"), store],
                       check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        flag = os.path.join(work, "slow")
        svc = Service(store, env={"LD_PRELOAD": lib, "SLOWDISK_FLAG": flag,
                                  "SLOWDISK_MS": str(args.fsync_ms),
                                  "TEXTSWAP_PRELOAD_SUPERVISOR_ONLY": "1"})
        try:
            for v in (1, 2):  # both loaded: v1 stays in probation, rollbacks are instant
                code, got = svc.mpost("/apply", {"name": "sent", "version": v})
                assert code == 200, got
            load = Load(svc, args.threads)
            for t in load.threads:
                t.start()
            time.sleep(2.0)  # warm
            phases: dict[str, tuple[float, float, list[float]]] = {}
            t = time.monotonic()
            time.sleep(args.seconds)
            phases["idle"] = (t, time.monotonic(), [])
            for name in ("fast", "slow"):
                if name == "slow":
                    open(flag, "w").close()
                took: list[float] = []
                t = time.monotonic()
                end = t + args.seconds
                version = 1
                while time.monotonic() < end:
                    # the other version is loaded in probation: each apply is
                    # the record write and the swap
                    t0 = time.monotonic()
                    code, got = svc.mpost("/apply", {"name": "sent", "version": version})
                    assert code == 200 and got["from_probation"], got
                    version = 3 - version
                    took.append(time.monotonic() - t0)
                    time.sleep(0.5)
                phases[name] = (t, time.monotonic(), took)
            load.stop.set()
            for th in load.threads:
                th.join(60)
            errors = sum(1 for _, _, c in load.samples if c != 200)
        finally:
            svc.stop()
        base = phases["idle"]
        b50 = pct(load.between(base[0], base[1]), 0.5)
        b99 = pct(load.between(base[0], base[1]), 0.99)
        print(f"\nserving under a slow disk: fsync {args.fsync_ms} ms in 'slow', "
              f"{args.threads} client threads, {args.seconds:.0f} s per phase, errors {errors}")
        print(f"{'phase':6} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99/idle':>9} "
              f"{'changes':>8} {'change median ms':>17} {'change max ms':>14}")
        for name, (a, b, took) in phases.items():
            lat = load.between(a, b)
            p99 = pct(lat, 0.99)
            med = 1000 * statistics.median(took) if took else float("nan")
            mx = 1000 * max(took) if took else float("nan")
            print(f"{name:6} {len(lat):8d} {1000 * pct(lat, 0.5):8.2f} {1000 * p99:8.2f} "
                  f"{p99 / b99:9.2f} {len(took):8d} {med:17.1f} {mx:14.1f}")
        print(f"(idle p50 {1000 * b50:.2f} ms)")
        return 0 if errors == 0 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
