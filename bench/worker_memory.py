"""A serving worker's memory: PSS, USS and where its private pages go.

    .venv/bin/python -m bench.worker_memory [--rounds 2] [--variants lean,keras] [--replicas 4]

Trains three versions through the service's own /train (a real service on
free ports): `bow` on the bundled Chinese reviews (the demo's architecture),
`auto` without the pretrained view and `auto` with it (views word, char,
pretrained) on a small English topic set, then, for each variant (one
service at a time, each on a copy of the store, `--rounds` times taking
turns), applies all three models (one worker each, forked from the zygote,
no standby), sends each 200 single-text and 20 batch-256 requests, waits
until the idle worker has given its freed heap back (the worker's own rate
bound, model_worker/worker.py TRIM_EVERY_S), and reads every worker's
/proc/PID/smaps: PSS, USS (private pages: what the worker alone costs, and
the figure that does not depend on how many processes share the libraries),
and the private pages by mapping (the C heap, anonymous mappings: TensorFlow's
and glibc's arenas, the model's weights; each shared library).

Variants (the service's settings or environment, so of every worker it forks):
    lean      the defaults: workers answer from the version's lean plan
              (model_worker/lean.py), TensorFlow untouched in the worker
    keras     worker.engine: keras, every model through Keras (before the
              lean engine)
    arena2    MALLOC_ARENA_MAX=2 (glibc: at most two malloc arenas a process)
    arena1    MALLOC_ARENA_MAX=1
`--replicas N` serves each model with N workers: PSS is then a worker's
share among 3N workers and the zygote, closer to a service holding many
models (the target's case) than three workers alone.
Results: a table on stdout and JSON in bench/results/.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESULTS = os.path.join(ROOT, "bench", "results")
CACHE = os.path.join(ROOT, "bench", ".cache", "memory-models")
DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
MODELS = {  # name: /train params
    "bow": {"architecture": "bow"},
    "auto": {"architecture": "auto", "pretrained": False},
    "autopre": {"architecture": "auto", "views": ["word", "char", "pretrained"]},
}
VARIANTS: dict[str, dict[str, str]] = {  # "engine": worker.engine; the rest: environment
    "lean": {},
    "keras": {"engine": "keras"},
    "arena2": {"MALLOC_ARENA_MAX": "2"},
    "arena1": {"MALLOC_ARENA_MAX": "1"},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def english_examples() -> list[dict[str, str]]:
    from tests.test_autoselect import english

    texts, labels = english()
    return [{"text": t, "label": y} for t, y in zip(texts, labels)]


def start(models_dir: str, workdir: str, tag: str, env: dict[str, str]) -> Any:
    from tests.helpers import Service

    env = dict(env)
    engine = env.pop("engine", "lean")
    cfg = os.path.join(workdir, f"config-{tag}.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        fh.write(f"worker:\n  standby: false\n  engine: {engine}\ntraining:\n  demo_on_empty_store: false\n"
                 "  max_concurrent: 2\n  data_roots: [" + json.dumps(os.path.join(ROOT, "data"))
                 + "]\nwatcher:\n  enabled: false\nrollout:\n  probation_s: 0\n"
                 "log_level: WARNING\n")
    return Service(models_dir, args=["--config", cfg], env=env,
                   log_path=os.path.join(workdir, f"service-{tag}.log"))


def train(workdir: str) -> str:
    """The store with the three models: from the cache, or trained now."""
    from tests.helpers import wait_for

    if os.path.isdir(CACHE) and all(os.path.isdir(os.path.join(CACHE, n)) for n in MODELS):
        return CACHE
    models = os.path.join(workdir, "train-models")
    svc = start(models, workdir, "train", {})
    try:
        jobs = {}
        for name, params in MODELS.items():
            data = ({"path": DEMO} if name == "bow" else {"examples": english_examples()})
            code, body = svc.mpost("/train", {"name": name, "data": data, "params": params,
                                              "apply": False})
            assert code == 202, body
            jobs[name] = body["job"]["id"]
        log("training bow, auto and auto with the pretrained view ...")
        for name, jid in jobs.items():
            job = wait_for(lambda: (lambda j: j if j["state"] in ("succeeded", "failed",
                                                                   "cancelled") else None)(
                svc.mget(f"/train/{jid}")[1]["job"]), 1200, f"training {name}", interval=1.0)
            assert job["state"] == "succeeded", job
            if name == "autopre":
                code, card = svc.mget(f"/models/{name}/{job['result']['version']}")
                assert card["report"]["pretrained"]["used"] is True, card["report"]
    finally:
        svc.stop()
    shutil.rmtree(CACHE, ignore_errors=True)
    os.makedirs(CACHE)
    for name in MODELS:
        shutil.copytree(os.path.join(models, name), os.path.join(CACHE, name))
    return CACHE


def smaps(pid: int) -> dict[str, Any]:
    """PSS, USS and the private pages by mapping kind, from /proc/PID/smaps (bytes)."""
    pss = uss = 0
    private: collections.Counter[str] = collections.Counter()
    name = "?"
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's header: range perms offset dev inode path
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
                if not path:
                    name = "anonymous (arenas, TensorFlow's buffers, weights)"
                elif path == "[heap]":
                    name = "[heap] (the main C heap: Python objects, small buffers)"
                elif path.startswith("["):
                    name = path
                elif ".so" in os.path.basename(path):
                    name = "lib " + os.path.basename(path).split(".so")[0]
                else:
                    name = "file " + os.path.basename(path)
                continue
            if head == "Pss:":
                pss += int(line.split()[1]) * 1024
            elif head in ("Private_Clean:", "Private_Dirty:"):
                n = int(line.split()[1]) * 1024
                uss += n
                private[name] += n
    return {"pss": pss, "uss": uss, "private": dict(private)}


def measure(models_dir: str, workdir: str, tag: str, env: dict[str, str], replicas: int = 1) -> dict[str, Any]:
    svc = start(models_dir, workdir, tag, env)
    try:
        for name in MODELS:
            code, body = svc.mpost("/apply", {"name": name, "version": 1, "replicas": replicas}, timeout=300)
            assert code == 200, body
        texts = [json.loads(line)["text"] for _, line in zip(range(256), open(DEMO,
                                                                         encoding="utf-8"))]
        english = [e["text"] for e in english_examples()]
        for name in MODELS:
            pool = texts if name == "bow" else english
            for i in range(200):
                code, body = svc.predict({"text": pool[i % len(pool)], "model": name})
                assert code == 200, body
            batch = (pool * (256 // len(pool) + 1))[:256]
            for _ in range(20 * replicas):  # the least busy replica takes each: all get some
                code, body = svc.predict({"texts": batch, "model": name})
                assert code == 200, body
        # the worker gives its freed heap back when idle after a large call, at
        # most every TRIM_EVERY_S: wait that out, then one call lets it trim
        from model_worker.worker import TRIM_EVERY_S
        time.sleep(TRIM_EVERY_S + 1.0)
        for name in MODELS:
            svc.predict({"text": "hello", "model": name})
        time.sleep(1.0)
        pids: dict[str, list[int]] = collections.defaultdict(list)
        for w in svc.status()["workers"]:
            if w.get("model") and w["state"] == "SERVING":
                pids[w["model"]["name"]].append(w["pid"])
        assert set(pids) == set(MODELS) and all(len(p) == replicas for p in pids.values()), pids
        # one worker a model: its figures (the replicas' differ by what each served)
        return {name: smaps(p[0]) for name, p in pids.items()}
    finally:
        svc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1, help="workers per model")
    ap.add_argument("--variants", default="lean,keras",
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    variants = args.variants.split(",")
    workdir = tempfile.mkdtemp(prefix="textswap-mem-")
    store = train(workdir)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            d = os.path.join(workdir, f"models-{v}-{r}")
            shutil.copytree(store, d)
            got = measure(d, workdir, f"{v}-{r}", VARIANTS[v], args.replicas)
            runs[v].append(got)
            log(f"round {r + 1} {v}: " + ", ".join(
                f"{n} PSS {m['pss'] / 2**20:.1f} USS {m['uss'] / 2**20:.1f} MB"
                for n, m in got.items()))
            shutil.rmtree(d, ignore_errors=True)
    mb = 2 ** 20
    print(f"\nworker memory, MB (medians of {args.rounds} rounds; PSS with {3 * args.replicas} workers "
          f"and the zygote sharing the libraries)")
    print(f"{'variant':<10}" + "".join(f"{n + ' PSS':>14}{n + ' USS':>14}" for n in MODELS))
    for v in variants:
        row = f"{v:<10}"
        for n in MODELS:
            row += f"{statistics.median(x[n]['pss'] for x in runs[v]) / mb:>14.1f}"
            row += f"{statistics.median(x[n]['uss'] for x in runs[v]) / mb:>14.1f}"
        print(row)
    for v in variants:
        print(f"\nprivate pages by mapping, {v} (round 1), MB:")
        first = runs[v][0]
        kinds = sorted({k for n in MODELS for k in first[n]["private"]},
                       key=lambda k: -sum(first[n]["private"].get(k, 0) for n in MODELS))
        print(f"  {'mapping':<58}" + "".join(f"{n:>9}" for n in MODELS))
        for k in kinds[:12]:
            print(f"  {k[:58]:<58}" + "".join(f"{first[n]['private'].get(k, 0) / mb:>9.1f}"
                                              for n in MODELS))
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"worker-memory-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": runs}, fh, indent=1)
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
