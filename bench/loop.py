"""The learning loop's bench (docs/loop.md): what logging costs, and a loop on a real set.

    .venv/bin/python -m bench.loop            # both parts
    .venv/bin/python -m bench.loop --cost     # only the logging cost
    .venv/bin/python -m bench.loop --loop     # only the loop
    make bench

1. Logging cost. Two services side by side with the same model, one with
   predictions.log true and one false; short load runs alternate between
   them (on, off, off, on, ...), each after the other went idle; medians:
   single-text POST
   /predict at concurrency 64 (the lean path) and 256-text requests at
   concurrency 4. Budget: at most 3 % fewer requests/s with the log on, by
   the medians; also given: the median and the mean (with its 95 %
   interval) of the rounds' own on/off ratios, the service's CPU a request
   split by process, and with --aa the same runs with the log off in both
   services (the machine's own noise floor).
2. The loop. The bundled review-sentiment set (data/demo, 6,000 real
   reviews), shuffled with a fixed seed: train on 30 % and serve it; predict
   the other 70 %; feed back the true labels of N of those predictions; a
   retrain policy (retrain_after_labels N, apply gate) retrains and applies;
   accuracy on the untouched remainder before and after, and each step's time.

Results: a table on stdout and JSON in bench/results/loop.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tests.helpers import Service, request, wait_for  # noqa: E402
from bench import serving  # noqa: E402  (its load generator and helpers)

DATA = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
RESULTS = os.path.join(ROOT, "bench", "results", "loop.json")
PARAMS = {"architecture": "bow", "epochs": 4}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rows() -> list[dict[str, str]]:
    with open(DATA, encoding="utf-8") as fh:
        out = [json.loads(line) for line in fh if line.strip()]
    random.Random(1337).shuffle(out)
    return out


def config(path: str, extra: str = "") -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
                 "worker:\n  standby_pool: 1\n" + extra)
    return path


def train(svc: Service, name: str, data: list[dict], apply: bool) -> dict[str, Any]:
    code, body = svc.mpost("/train", {"name": name, "data": {"examples": data},
                                      "params": PARAMS, "apply": apply})
    assert code == 202, body
    jid = body["job"]["id"]

    def done():
        job = svc.mget(f"/train/{jid}")[1]["job"]
        return job["state"] in ("succeeded", "failed", "cancelled") and job
    job = wait_for(done, 1800, f"job {jid}", interval=0.5)
    assert job["state"] == "succeeded", job
    return job


# -- 1. logging cost -------------------------------------------------------------------------
def settled_cpu_s(pid: int, deadline_s: float = 20.0) -> float:
    """tree_cpu_s once the service is idle again (the log's writer process,
    at a lower priority, may still be writing what the load left it)."""
    end = time.monotonic() + deadline_s
    last = tree_cpu_s(pid)
    while time.monotonic() < end:
        time.sleep(0.3)
        now = tree_cpu_s(pid)
        if now - last < 0.01:
            return now
        last = now
    return last


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its live
    descendants (the supervisor, its zygote, workers and log writer), from /proc."""
    return sum(tree_cpu_roles(pid).values())


def tree_cpu_roles(pid: int) -> dict[str, float]:
    """tree_cpu_s split by role: the supervisor itself, the prediction log's
    writer process, and the rest (zygote, workers, trainers)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])
    tree, todo = {pid}, [pid]
    while todo:
        p = todo.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in tree:
                tree.add(child)
                todo.append(child)
    out = {"supervisor": 0.0, "log writer": 0.0, "workers": 0.0}
    hz = os.sysconf("SC_CLK_TCK")
    for p in tree:
        role = "supervisor" if p == pid else "workers"
        if p != pid:
            try:
                with open(f"/proc/{p}/cmdline", "rb") as fh:
                    if b"predlog_writer" in fh.read():
                        role = "log writer"
            except OSError:
                pass
        out[role] += ticks.get(p, 0) / hz
    return out


def cost(workdir: str, seconds: float, rounds: int, only: str | None = None,
         aa: bool = False) -> dict[str, Any]:
    """Two services side by side, the same model, the log on in one and off in
    the other; short load runs alternate between them (on, off, off, on, ...),
    each after the other service has gone idle (its log writer included), so
    that both see the same machine: its load drifts over minutes, and one
    service per phase measured that drift as much as the log. aa: the log
    off in both (the bench's own noise floor); only: one of the two loads."""
    models = os.path.join(workdir, "models")
    svc = Service(models, args=["--config", config(os.path.join(workdir, "c.yaml"))])
    try:
        train(svc, "rev", rows()[:2000], apply=True)
        wait_for(lambda: svc.get("/readyz")[0] == 200, 120, "rev serving")
    finally:
        svc.stop()
    shutil.copytree(models, os.path.join(workdir, "models-off"))
    texts = [r["text"] for r in rows()[:3000]]
    single = serving.write_bodies(os.path.join(workdir, "single.jsonl"),
                                  [{"text": t} for t in texts])
    batch = serving.write_bodies(os.path.join(workdir, "batch.jsonl"),
                                 [{"texts": texts[i:i + 256]} for i in range(0, 2560, 256)])
    gen = serving.LoadGen("wrk" if shutil.which("wrk") else "client", workdir)
    log(f"load generator: {gen.kind}")
    figures: dict[str, dict[str, list[float]]] = {
        "single_c64": {"on": [], "off": []}, "batch256_c4": {"on": [], "off": []}}
    cpu: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in figures}
    split: dict[str, dict[str, list[float]]] = {k: {"supervisor": [], "log writer": []}
                                                for k in figures}
    svcs: dict[str, Service] = {}
    try:
        for mode in ("on", "off"):
            cfg = config(os.path.join(workdir, f"{mode}.yaml"),
                         f"predictions:\n  log: {'true' if mode == 'on' and not aa else 'false'}\n")
            svcs[mode] = Service(models if mode == "on" else os.path.join(workdir, "models-off"),
                                 args=["--config", cfg])
        for s in svcs.values():
            wait_for(lambda s=s: s.get("/readyz")[0] == 200, 180, "serving")
            s.wait_standby()
        for key, bodies, conc, per in (("single_c64", single, 64, 1),
                                       ("batch256_c4", batch, 4, 256)):
            if only and key != only:
                continue
            for s in svcs.values():
                gen.result(gen.start(s.port, bodies, conc, 2), 2, per)  # warm-up
                settled_cpu_s(s.proc.pid)
            for r in range(rounds):
                for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    s = svcs[mode]
                    roles0 = tree_cpu_roles(s.proc.pid)
                    res = gen.result(gen.start(s.port, bodies, conc, seconds), seconds, per)
                    n_req = max(1, res["rps"] * seconds)
                    settled_cpu_s(s.proc.pid)  # its writer done before the other runs
                    roles1 = tree_cpu_roles(s.proc.pid)
                    d = {k: (roles1[k] - roles0[k]) / n_req * 1e3 for k in roles1}
                    figures[key][mode].append(res["rps"])
                    cpu[key][mode].append(sum(d.values()))
                    if mode == "on":
                        for k in split[key]:
                            split[key][k].append(d[k])
                    log(f"round {r + 1} log {mode}: {key} {res['rps']:.0f} req/s, "
                        f"{sum(d.values()):.3f} CPU ms a request ("
                        + ", ".join(f"{k} {v:.3f}" for k, v in d.items()) + ")")
    finally:
        for s in svcs.values():
            s.stop()
    out: dict[str, Any] = {"load_generator": gen.kind, "aa": aa}
    for key, f in figures.items():
        if not f["on"]:
            continue
        on, off = statistics.median(f["on"]), statistics.median(f["off"])
        c_on, c_off = statistics.median(cpu[key]["on"]), statistics.median(cpu[key]["off"])
        # each round's on and off ran back to back: their ratio is less swayed
        # by the machine's load drifting over the minutes of the bench
        ratios = [1 - a / b for a, b in zip(f["on"], f["off"])]
        paired = statistics.median(ratios)
        half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
        out[key] = {"rps_log_on": round(on, 1), "rps_log_off": round(off, 1),
                    "cost": round(1 - on / off, 4), "paired_cost": round(paired, 4),
                    # the mean of the rounds' ratios and its 95 % interval: how
                    # far this machine's noise lets the bench see
                    "paired_mean": round(statistics.mean(ratios), 4),
                    "paired_ci95": [round(statistics.mean(ratios) - half, 4),
                                    round(statistics.mean(ratios) + half, 4)],
                    "runs": f,
                    # the service's CPU (every process of it) per request: what
                    # the log adds, less swayed by other load on the machine
                    "cpu_ms_log_on": round(c_on, 4), "cpu_ms_log_off": round(c_off, 4),
                    "cpu_cost": round(c_on / c_off - 1, 4), "cpu_runs": cpu[key],
                    "log_writer_cpu_ms": round(statistics.median(split[key]["log writer"]), 4),
                    "within_budget": 1 - on / off <= 0.03}
    return out


# -- 2. the loop ------------------------------------------------------------------------------
def predict_all(svc: Service, texts: list[str]) -> tuple[list[str], list[tuple[str, int]], float]:
    """(labels, (request id, index) per text, seconds)."""
    labels, ids = [], []
    t = time.monotonic()
    for i in range(0, len(texts), 256):
        code, body = svc.predict({"texts": texts[i:i + 256], "model": "loop"})
        assert code == 200, body
        labels += [p["label"] for p in body["predictions"]]
        ids += [(body["request_id"], j) for j in range(len(body["predictions"]))]
    return labels, ids, time.monotonic() - t


def accuracy(pred: list[str], truth: list[str]) -> float:
    return round(sum(p == t for p, t in zip(pred, truth)) / len(truth), 4)


def the_loop(workdir: str, n_feedback: int) -> dict[str, Any]:
    data = rows()
    cut = int(0.3 * len(data))
    train_rows, rest = data[:cut], data[cut:]
    fed, untouched = rest[:n_feedback], rest[n_feedback:]
    svc = Service(os.path.join(workdir, "models"),
                  args=["--config", config(os.path.join(workdir, "l.yaml"))])
    steps: dict[str, float] = {}
    try:
        t = time.monotonic()
        train(svc, "loop", train_rows, apply=True)
        wait_for(lambda: (svc.serving() or {}).get("name") == "loop", 120, "loop serving")
        steps["train_30pct_and_apply_s"] = round(time.monotonic() - t, 2)
        texts = [r["text"] for r in rest]
        pred, ids, took = predict_all(svc, texts)
        steps["predict_rest_s"] = round(took, 2)
        before = accuracy(pred[n_feedback:], [r["label"] for r in untouched])
        code, body = svc.request_put("/models/loop/policy",
                                     {"retrain_after_labels": n_feedback, "apply": "gate"})
        assert code == 200, body
        t = time.monotonic()
        by_request: dict[str, list[tuple[int, str]]] = {}
        for (rid, idx), r in zip(ids[:n_feedback], fed):
            by_request.setdefault(rid, []).append((idx, r["label"]))
        for rid, items in by_request.items():
            for idx, label in items:
                code, body = request(svc.port, "POST", "/feedback",
                                     {"request_id": rid, "index": idx, "label": label})
                assert code == 200, body
        steps["feedback_s"] = round(time.monotonic() - t, 2)
        t = time.monotonic()

        def finished():
            hist = svc.mget("/history?name=loop&limit=50")[1]["history"]
            return [h for h in hist if h["kind"] in ("retrain_done", "retrain_failed")]
        done = wait_for(finished, 1800, "the policy's retraining", interval=1.0)[0]
        steps["policy_retrain_and_apply_s"] = round(time.monotonic() - t, 2)
        d = done.get("details") or {}
        after_pred, _, _ = predict_all(svc, [r["text"] for r in untouched])
        after = accuracy(after_pred, [r["label"] for r in untouched])
        serving_now = svc.serving()
        return {"set": "data/demo/sentiment_zh.jsonl (6,000 reviews, 2 labels)",
                "train_rows": len(train_rows), "feedback_labels": n_feedback,
                "untouched": len(untouched), "accuracy_before": before,
                "accuracy_after": after, "steps": steps,
                "policy": {"history": done["reason"], "applied": d.get("applied"),
                           "version": d.get("version"), "held_out": d.get("held_out"),
                           "gate": {k: (d.get("gate") or {}).get(k)
                                    for k in ("passed", "golden_examples")},
                           "gate_candidate_accuracy": ((d.get("gate") or {}).get("candidate")
                                                       or {}).get("accuracy"),
                           "gate_serving_accuracy": ((d.get("gate") or {}).get("serving")
                                                     or {}).get("accuracy"),
                           "serving_after": serving_now and serving_now.get("version")}}
    finally:
        svc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cost", action="store_true", help="only the logging cost")
    p.add_argument("--loop", action="store_true", help="only the loop")
    p.add_argument("--seconds", type=float, default=2.0, help="per load run")
    p.add_argument("--rounds", type=int, default=30, help="on/off pairs of the cost runs")
    p.add_argument("--feedback", type=int, default=1000, help="labels fed back (N)")
    p.add_argument("--only", choices=["single_c64", "batch256_c4"], help="one cost load")
    p.add_argument("--aa", action="store_true",
                   help="the cost runs with the log off in both services: the noise floor")
    args = p.parse_args(argv)
    both = not args.cost and not args.loop
    res: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}}
    with tempfile.TemporaryDirectory(prefix="textswap-loop-") as tmp:
        if args.cost or both:
            os.makedirs(os.path.join(tmp, "cost"))
            res["logging_cost"] = cost(os.path.join(tmp, "cost"), args.seconds, args.rounds,
                                       args.only, args.aa)
        if args.loop or both:
            os.makedirs(os.path.join(tmp, "loop"))
            res["loop"] = the_loop(os.path.join(tmp, "loop"), args.feedback)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=2, ensure_ascii=False)
    print(json.dumps(res, indent=2, ensure_ascii=False))
    bad = [k for k, v in res.get("logging_cost", {}).items()
           if isinstance(v, dict) and not v["within_budget"]]
    if bad:
        print(f"logging cost over the 3% budget: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
