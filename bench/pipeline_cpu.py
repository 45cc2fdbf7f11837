"""The supervisor's CPU per single-text request, of two trees of the code side by side.

    .venv/bin/python -m bench.pipeline_cpu BEFORE_ROOT [AFTER_ROOT]
        [--requests 4000] [--rounds 10] [--concurrency 16] [--rate R] [--path /predict]

Each root is a checkout of this repository (e.g. `git worktree add /tmp/before
<commit>`); AFTER_ROOT defaults to this one. Both run as services at once, on
copies of one model store holding one tiny model (tests/tinymodels.py), with
the default configuration (prediction log on, the lean path). A round sends
exactly N single-text POST /predict requests (keep-alive connections, from a
client process of its own; as fast as answered, or paced at --rate) to one service, then to the other, alternating
which goes first; each side's figure is the supervisor process's own CPU
time (utime + stime from /proc/<pid>/stat, not its workers or log writer)
over those N requests, divided by N. Reported: the medians of each side, the
ratio after/before of the medians, the median of the rounds' own
after/before ratios, and the requests per second (the HTTP figure, which
the machine's other load sways far more than the CPU time).

Results: a table on stdout and JSON in bench/results/pipeline_cpu.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(HERE, "bench", "results", "pipeline_cpu.json")
TEXTS = ["very good, love it", "terrible product", "今天下雨", "很好用", "awful", "喜欢",
         "the train leaves at noon", "差评", "excellent", "numbers 123"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# both trees' admin key, given to each service (any tree with keys takes it)
ADMIN = "bench-pipeline-admin-key-of-32-characters-or-more"


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {ADMIN}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except OSError:
        return 0, None


def wait(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


class Side:
    """One tree's service."""

    def __init__(self, label: str, root: str, models: str, workdir: str) -> None:
        self.label, self.root = label, root
        self.port, self.mport = free_port(), free_port()
        cfg = os.path.join(workdir, f"{label}.yaml")
        with open(cfg, "w", encoding="utf-8") as fh:
            fh.write("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n")
        self.log = open(os.path.join(workdir, f"{label}.log"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(root, "supervisor.py"), "--config", cfg,
             "--models-dir", models, "--host", "127.0.0.1", "--port", str(self.port),
             "--manage-port", str(self.mport)],
            cwd=root, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TEXTSWAP_MANAGEMENT_TOKEN": ADMIN})
        wait(lambda: call(self.port, "GET", "/healthz")[0] == 200, 60, f"{label} /healthz")
        code, body = call(self.mport, "POST", "/apply", {"name": "sent"})
        if code != 200:
            raise RuntimeError(f"{label}: apply answered {code}: {body}")
        wait(lambda: call(self.port, "GET", "/readyz")[0] == 200, 120, f"{label} serving")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- the client: exactly n requests, keep-alive, in its own process ----------------------------
def client(port: int, path: str, conc: int, n: int, rate: float = 0.0) -> None:
    bodies = [json.dumps({"text": t}).encode() for t in TEXTS]
    reqs = [(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
             f"application/json\r\nContent-Length: {len(b)}\r\n\r\n").encode() + b
            for b in bodies]
    left = [n]
    bad = [0]

    async def one(k: int, t0: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k
        gap = conc / rate if rate else 0.0  # each connection's share of the rate
        due = t0 + k * gap / conc
        while left[0] > 0:
            if gap:
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                due += gap
            left[0] -= 1
            i += 1
            writer.write(reqs[i % len(reqs)])
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if head[9:12] != b"200":
                bad[0] += 1
        writer.close()

    async def main() -> float:
        t0 = time.monotonic()
        await asyncio.gather(*(one(k, t0) for k in range(conc)))
        return time.monotonic() - t0

    dt = asyncio.run(main())
    print(json.dumps({"seconds": dt, "bad": bad[0]}), flush=True)


def run_load(side: Side, path: str, conc: int, n: int, rate: float = 0.0
             ) -> dict[str, float]:
    c0 = side.cpu_s()
    out = subprocess.run([sys.executable, "-m", "bench.pipeline_cpu", "--client",
                          json.dumps([side.port, path, conc, n, rate])],
                         capture_output=True, text=True, timeout=600, check=True, cwd=HERE).stdout
    c1 = side.cpu_s()
    res = json.loads(out.strip().splitlines()[-1])
    if res["bad"]:
        raise RuntimeError(f"{side.label}: {res['bad']} answers were not 200")
    return {"cpu_us": (c1 - c0) / n * 1e6, "rps": n / res["seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before", nargs="?", help="root of the tree measured as 'before'")
    p.add_argument("after", nargs="?", default=HERE, help="root of the 'after' tree")
    p.add_argument("--requests", type=int, default=4000, help="requests per side and round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--path", default="/predict")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests a second, paced (0: as fast as the service answers); "
                        "under the service's capacity both sides see the same load, so "
                        "their CPU per request is not swayed by how much the IOLoop "
                        "could batch at the throughput each happened to reach")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        client(*json.loads(args.client))
        return 0
    if not args.before:
        p.error("the 'before' root is required")
    tmp = tempfile.mkdtemp(prefix="pipeline-cpu-")
    sides: list[Side] = []
    try:
        store = os.path.join(tmp, "store")
        log("building a tiny model (TensorFlow, in its own process)")
        # `python -c` imports from its working folder: this checkout's tests package
        subprocess.run([sys.executable, "-c",
                        "import sys; from tests import tinymodels; "
                        "tinymodels.build(sys.argv[1], 'sent', ['neg', 'pos'])",
                        store], check=True, cwd=HERE)
        for label, root in (("before", os.path.abspath(args.before)),
                            ("after", os.path.abspath(args.after))):
            shutil.copytree(store, os.path.join(tmp, f"models-{label}"))
            sides.append(Side(label, root, os.path.join(tmp, f"models-{label}"), tmp))
        for s in sides:  # warm-up: the worker's first calls, the supervisor's caches
            run_load(s, args.path, args.concurrency, min(args.requests, 1000), args.rate)
        runs: dict[str, list[dict[str, float]]] = {s.label: [] for s in sides}
        for r in range(args.rounds):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                res = run_load(s, args.path, args.concurrency, args.requests, args.rate)
                runs[s.label].append(res)
                log(f"round {r + 1} {s.label}: {res['cpu_us']:.1f} us CPU a request, "
                    f"{res['rps']:.0f} req/s")
    finally:
        for s in sides:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(x["cpu_us"] for x in v) for k, v in runs.items()}
    rps = {k: statistics.median(x["rps"] for x in v) for k, v in runs.items()}
    paired = [a["cpu_us"] / b["cpu_us"] for a, b in zip(runs["after"], runs["before"])]
    out = {"before_root": os.path.abspath(args.before), "after_root": os.path.abspath(args.after),
           "requests_per_round": args.requests, "rounds": args.rounds,
           "concurrency": args.concurrency, "rate": args.rate, "path": args.path,
           "cpu_us_per_request_median": {k: round(v, 2) for k, v in med.items()},
           "ratio_after_before": round(med["after"] / med["before"], 4),
           "paired_ratio_median": round(statistics.median(paired), 4),
           "rps_median": {k: round(v, 1) for k, v in rps.items()},
           "rps_ratio_after_before": round(rps["after"] / rps["before"], 4),
           "runs": runs}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
