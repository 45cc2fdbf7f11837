"""Cluster scale: 5, 10 and 20 nodes on one Redis and one shared store.

    nice .venv/bin/python -m bench.cluster_scale [--sizes 5,10,20] [--applies 10]
                                                 [--idle 10]

Everything on this machine (real redis-server; tiny models of
tests/tinymodels.py; each node a supervisor, its zygote, a serving worker
and a preloading standby). For each size:

- idle: Redis's own counters (INFO commandstats, used_cpu_*) over --idle
  seconds with every node up and converged: commands per second per node,
  heartbeats (SETs) per second per node, and Redis CPU per node, from which
  "nodes per Redis at 10 % of a core" follows;
- --applies applies of sent v2 / v1 in turn, each on the next node: every
  node is probed directly (one thread each, a request every 10 ms) for its
  first answer from the new version; the skew is the spread of those times,
  "call to last" the time from the POST to the last node's first answer
  (target: skew <= 1 s at the median; no node behind > 5 s);
- memory: each supervisor's RSS, and each node's whole tree (PSS, so the
  zygote's pages shared with its workers count once).

Results: a table on stdout and JSON in bench/results/cluster-scale-*.json.
On a small machine every node shares the same cores: the skew and times
include that contention (the table gives the load average).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
import redis  # noqa: E402

from tests.clusterkit import Node  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from deploy.localcluster import RedisServer, have_redis_and_nginx  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
SKEW_TARGET_S = 1.0
BEHIND_MAX_S = 5.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Probe:
    """One thread per node: POST /predict to the node itself every 10 ms;
    first[node] is when it first answered `version`."""

    def __init__(self, nodes: list[Node], version: int) -> None:
        self.version = version
        self.first: dict[str, float] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                         for n in nodes]
        for t in self._threads:
            t.start()

    def _run(self, node: Node) -> None:
        body = json.dumps({"text": "很好"}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
        while not self._stop.is_set() and node.node_id not in self.first:
            try:
                conn.request("POST", "/predict", body=body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                payload = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
                continue
            at = time.time()
            if resp.status == 200 and json.loads(payload)["model"]["version"] == self.version:
                self.first[node.node_id] = at
                break
            self._stop.wait(0.01)
        conn.close()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def redis_counters(r: redis.Redis) -> dict[str, float]:
    stats = r.info("commandstats")
    cpu = r.info("cpu")
    out = {k[len("cmdstat_"):]: float(v["calls"]) for k, v in stats.items()}
    out["_cpu"] = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    out["_total"] = sum(v for k, v in out.items() if not k.startswith("_"))
    return out


def rates(before: dict[str, float], after: dict[str, float], seconds: float,
          nodes: int) -> dict[str, Any]:
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"commands_per_s_per_node": round(diff["_total"] / seconds / nodes, 2),
            "set_per_s_per_node": round(diff.get("set", 0.0) / seconds / nodes, 2),
            "redis_cpu_per_node": round(diff["_cpu"] / seconds / nodes, 5),
            "redis_cpu": round(diff["_cpu"] / seconds, 4),
            "top_commands_per_s": {k: round(v / seconds, 1) for k, v in sorted(
                diff.items(), key=lambda kv: -kv[1]) if not k.startswith("_") and v > 0
                                   }}


def converged(node: Node, n: int, rev: int, version: int) -> bool:
    code, body = node.mget("/cluster")
    if code != 200 or len(body["nodes"]) < n:
        return False
    return all(b["revision"] >= rev and b["serving"].get("sent", {}).get("version") == version
               for b in body["nodes"])


def memory(nodes: list[Node]) -> dict[str, Any]:
    sup, tree = [], []
    for n in nodes:
        p = psutil.Process(n.proc.pid)
        sup.append(p.memory_info().rss / 2**20)
        total = 0.0
        for q in [p, *p.children(recursive=True)]:
            try:
                total += q.memory_full_info().pss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        tree.append(total)
    return {"supervisor_rss_mb_median": round(statistics.median(sup), 1),
            "supervisor_rss_mb_max": round(max(sup), 1),
            "node_tree_pss_mb_median": round(statistics.median(tree), 1),
            "all_nodes_pss_mb": round(sum(tree), 1)}


def run_size(size: int, models_src: str, args: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"textswap-scale-{size}-")
    models = os.path.join(work, "models")
    shutil.copytree(models_src, models)
    cfg = os.path.join(work, "config.yaml")
    with open(cfg, "w") as fh:  # a rollback on a loaded machine would be noise here
        # many TensorFlow imports at once on a small machine: generous timeouts
        fh.write("rollout:\n  max_latency_ratio: 1000.0\ncluster:\n  prepare_timeout: 300\n"
                 "worker:\n  boot_timeout: 300\n  load_timeout: 300\n")
    server = RedisServer(work)
    r = redis.Redis(port=server.port, password=server.password)
    nodes = [Node(models, server.url, f"node{i:02d}", work, extra=["--config", cfg])
             for i in range(1, size + 1)]
    out: dict[str, Any] = {"nodes": size}
    try:
        t0 = time.monotonic()
        for n in nodes:  # a few at a time: 20 TensorFlow imports at once thrash 2 cores
            n.start(wait=False)
            time.sleep(1.0)
        for n in nodes:
            wait_for(lambda: n.get("/healthz")[0] == 200, 600, f"{n.node_id} /healthz")
        for n in nodes:  # its zygote up and a standby waiting: ready for an apply
            wait_for(lambda: any(w.get("state") in ("STANDBY", "READY")
                                 for w in n.status().get("pool") or []), 600,
                     f"{n.node_id}'s standby", interval=0.5)
        wait_for(lambda: len((nodes[0].mget("/cluster")[1] or {}).get("nodes") or []) == size,
                 60, "every node's heartbeat")
        out["start_s"] = round(time.monotonic() - t0, 1)
        log(f"{size} nodes up in {out['start_s']}s")
        code, body = nodes[0].mpost("/apply", {"name": "sent", "version": 1}, timeout=600)
        assert code == 200, body
        wait_for(lambda: converged(nodes[0], size, body["cluster"]["revision"], 1), 600,
                 "all nodes on sent v1", interval=0.5)
        time.sleep(3)  # the standbys' preloads settle
        before = redis_counters(r)
        time.sleep(args.idle)
        out["idle"] = rates(before, redis_counters(r), args.idle, size)
        log(f"idle: {out['idle']['commands_per_s_per_node']} commands/s/node, Redis CPU "
            f"{out['idle']['redis_cpu']:.4f}")
        rows = []
        before = redis_counters(r)
        t_applies = time.monotonic()
        for i in range(args.applies):
            version = 2 if i % 2 == 0 else 1
            node = nodes[i % size]
            probe = Probe(nodes, version)
            try:
                t_call = time.time()
                code, body = node.mpost("/apply", {"name": "sent", "version": version},
                                        timeout=600)
                answered = time.time() - t_call
                assert code == 200, body
                wait_for(lambda: len(probe.first) == size, 120,
                         "every node answering the new version", interval=0.02)
            finally:
                probe.stop()
            firsts = sorted(probe.first.values())
            rows.append({"version": version, "on": node.node_id,
                         "skew_s": round(firsts[-1] - firsts[0], 3),
                         "call_to_last_s": round(firsts[-1] - t_call, 3),
                         "apply_call_s": round(answered, 3),
                         "prepare_s": (body["cluster"].get("prepare") or {}).get("prepare_s")})
            log(f"apply {i + 1}: skew {rows[-1]['skew_s']}s, call to last "
                f"{rows[-1]['call_to_last_s']}s, /apply {answered:.2f}s")
            time.sleep(1.0)
        spent = time.monotonic() - t_applies
        out["applying"] = rates(before, redis_counters(r), spent, size)
        out["applies"] = rows
        skews = [x["skew_s"] for x in rows]
        lasts = [x["call_to_last_s"] for x in rows]
        out.update({"skew_median_s": round(statistics.median(skews), 3),
                    "skew_max_s": round(max(skews), 3),
                    "call_to_last_median_s": round(statistics.median(lasts), 3),
                    "call_to_last_max_s": round(max(lasts), 3),
                    "met": statistics.median(skews) <= SKEW_TARGET_S
                    and max(skews) <= BEHIND_MAX_S,
                    "memory": memory(nodes), "loadavg": os.getloadavg()[0]})
    finally:
        for n in nodes:
            n.proc and n.proc.terminate()
        for n in nodes:
            n.stop()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="5,10,20")
    p.add_argument("--applies", type=int, default=10)
    p.add_argument("--idle", type=float, default=10.0)
    p.add_argument("--keep", action="store_true", help="keep the work folders")
    args = p.parse_args(argv)
    if not have_redis_and_nginx():
        print("redis-server is needed: apt-get install redis-server", file=sys.stderr)
        return 2
    src = tempfile.mkdtemp(prefix="textswap-scale-models-")
    models = os.path.join(src, "models")
    log("building tiny models")
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tinymodels.py"), models],
                   check=True, cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                   stdout=subprocess.DEVNULL)
    results: list[dict[str, Any]] = []
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"cluster-scale-{time.strftime('%Y%m%d-%H%M%S')}.json")
    for size in [int(s) for s in args.sizes.split(",")]:
        try:
            results.append(run_size(size, models, args))
        except Exception as exc:  # say what limit was hit, keep what was measured
            log(f"{size} nodes: stopped: {type(exc).__name__}: {exc}")
            results.append({"nodes": size, "error": f"{type(exc).__name__}: {exc}"})
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"machine": {"cpus": os.cpu_count(),
                                   "mem_gb": round(psutil.virtual_memory().total / 2**30, 1)},
                       "sizes": results}, fh, indent=1)
    shutil.rmtree(src, ignore_errors=True)
    print("\n| nodes | skew median / max (s) | call to last median / max (s) | "
          "commands/s/node idle / applying | heartbeats (SET)/s/node | Redis CPU/node idle "
          "| supervisor RSS (MB) | node tree PSS (MB) | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in results:
        if "error" in x:
            print(f"| {x['nodes']} | {x['error']} |")
            continue
        print(f"| {x['nodes']} | {x['skew_median_s']} / {x['skew_max_s']} | "
              f"{x['call_to_last_median_s']} / {x['call_to_last_max_s']} | "
              f"{x['idle']['commands_per_s_per_node']} / "
              f"{x['applying']['commands_per_s_per_node']} | "
              f"{x['idle']['set_per_s_per_node']} | {x['idle']['redis_cpu_per_node']:.5f} | "
              f"{x['memory']['supervisor_rss_mb_median']} | "
              f"{x['memory']['node_tree_pss_mb_median']} | {x['loadavg']:.1f} |")
    print(f"results: {os.path.relpath(path, ROOT)}")
    return 0 if all(x.get("met") for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())
