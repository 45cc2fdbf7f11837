"""What architecture "auto" costs the serving path, measured on the real service.

    .venv/bin/python -m bench.autoserve            # about 4-6 minutes
    .venv/bin/python -m bench.autoserve --quick    # shorter load runs
    .venv/bin/python -m bench.autoserve --graph-speeds  # only the graphs' speeds (1 min)

One service (real supervisor, worker and trainer processes, 127.0.0.1 only),
in one run:

  1. an `auto` model (default params), an `auto` model held to the word
     view (`views: ["word"]`) and a `bow` model trained through POST /train
     on the bundled Chinese reviews, all applied (each its own worker);
  2. texts/s with 256 texts per POST /predict (concurrency 4) for each
     model, alternating, best of the runs: the ratios auto / bow and
     auto (word view) / bow (target >= 0.8);
  3. single-text POST /predict p99 at concurrency 8 on the auto model, idle
     (before and after; the lower counts), and while an `auto` training job
     (default params, the same 6,000 texts) runs in the trainer: the ratio
     training / idle (target <= 1.5).

Load comes from bench/serving.py's generator (wrk when installed, else its
asyncio client), sharing the CPUs with the service as a real client would.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from bench import serving  # noqa: E402  (the load generator and service helpers)

BATCH = serving.BATCH_TEXTS
DATA_REL = serving.DATA_REL
P99_TARGET = 1.5


def train(svc: Any, name: str, params: dict) -> dict:
    from tests.helpers import wait_for

    code, body = svc.mpost("/train", {"name": name, "data": {"path": DATA_REL}, "params": params})
    assert code == 202, body
    job_id = body["job"]["id"]

    def done() -> Any:
        job = svc.mget(f"/train/{job_id}")[1]["job"]
        if job["state"] in ("failed", "cancelled"):
            raise SystemExit(f"training {name} {job['state']}: {job.get('error')}\n{job.get('log_tail')}")
        return job if job["state"] == "succeeded" else None
    return wait_for(done, 900, f"training {name}", interval=0.5)


def apply(svc: Any, name: str) -> None:
    code, body = svc.mpost("/apply", {"name": name}, timeout=300)
    assert code == 200, body


def graph_speeds(rounds: int = 5) -> dict[str, Any]:
    """auto's serving-cost rule times the final graphs (autoselect.serving_speeds, side by side):
    a word-only graph against a two-member word+char one, on the small English
    set of tests/test_autoselect.py, best of `rounds`. The word-only graph
    should serve faster (tests/test_costaware.py checks the rule with given
    speeds, not this ranking, which is a timing)."""
    import time

    import numpy as np

    from model_worker import autoselect
    from model_worker.params import validate_params
    from tests.test_autoselect import REPRODUCIBLE, english

    texts, labels = english()
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    search = autoselect.Search(texts, y, len(names), validate_params(REPRODUCIBLE), "word",
                               time.monotonic(), None, None)
    out = {"word": 0.0, "word+char x2": 0.0}
    for _ in range(rounds):
        speeds = autoselect.serving_speeds(search, [(("word",), 1), (("char", "word"), 2)])
        out["word"] = max(out["word"], speeds[(("word",), 1)])
        out["word+char x2"] = max(out["word+char x2"], speeds[(("char", "word"), 2)])
    out["word_faster"] = out["word"] > out["word+char x2"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter load runs")
    ap.add_argument("--graph-speeds", action="store_true",
                    help="only the texts/s of a word-only and a word+char graph")
    args = ap.parse_args(argv)
    if args.graph_speeds:
        print(json.dumps(graph_speeds(), indent=2))
        return 0
    dur = 4.0 if args.quick else 10.0
    rounds = 2 if args.quick else 3
    workdir = tempfile.mkdtemp(prefix="textswap-autoserve-")
    gen = serving.LoadGen("wrk" if shutil.which("wrk") else "python", workdir)
    texts = serving.read_texts()
    models_dir = os.path.join(workdir, "models")
    cfg = serving.write_config(os.path.join(workdir, "config.yaml"), models_dir, standby=True)
    from tests.helpers import Service, wait_for

    svc = Service(models_dir, args=["--config", cfg], log_path=os.path.join(workdir, "service.log"))
    out: dict[str, Any] = {"loadgen": gen.kind}
    try:
        serving.log("training the bow and auto models through /train ...")
        wait_for(lambda: (svc.status().get("jobs") or [{}])[0].get("state") == "succeeded", 600,
                 "the demo model")
        bow_job = train(svc, "bow", {"architecture": "bow"})
        auto_job = train(svc, "auto", {})
        word_job = train(svc, "auto_word", {"views": ["word"]})
        meta = svc.mget("/models/auto/1")[1]
        out["auto_model"] = {"chosen": meta["report"]["chosen"]["name"],
                             "train_s": meta["train_seconds"], "export_s": meta.get("export_seconds"),
                             "job_elapsed_s": auto_job["elapsed_s"]}
        out["bow_model"] = {"train_s": svc.mget("/models/bow/1")[1]["train_seconds"],
                            "job_elapsed_s": bow_job["elapsed_s"]}
        word_meta = svc.mget("/models/auto_word/1")[1]
        out["auto_word_model"] = {"chosen": word_meta["report"]["chosen"]["name"],
                                  "train_s": word_meta["train_seconds"], "job_elapsed_s": word_job["elapsed_s"]}
        apply(svc, "bow")
        apply(svc, "auto")
        apply(svc, "auto_word")

        # -- 256 texts a request, auto vs bow ---------------------------------------------
        tput: dict[str, list[float]] = {"bow": [], "auto": [], "auto_word": []}
        for name in tput:
            path = os.path.join(workdir, f"batch-{name}.jsonl")
            serving.write_bodies(path, [{"model": name, "texts": [texts[(i * BATCH + j) % len(texts)]
                                                                  for j in range(BATCH)]}
                                        for i in range(40)])
        for r in range(rounds):
            for name in tput:
                res = gen.run(svc.port, os.path.join(workdir, f"batch-{name}.jsonl"), serving.CONC_BATCH,
                              dur, texts_per_request=BATCH)
                assert res["errors"] == 0, res
                tput[name].append(res["texts_per_s"])
                serving.log(f"round {r + 1}: {name} {res['texts_per_s']:.0f} texts/s")
        out["batch256_texts_per_s"] = {k: round(max(v)) for k, v in tput.items()}

        # -- single-text p99 at c=8: idle vs during an auto training -----------------------
        single = serving.write_bodies(os.path.join(workdir, "single.jsonl"),
                                      [{"model": "auto", "text": t} for t in texts[:2000]])
        idle = gen.run(svc.port, single, serving.CONC_LATENCY, dur)
        code, body = svc.mpost("/train", {"name": "auto2", "data": {"path": DATA_REL}, "params": {}})
        assert code == 202, body
        job_id = body["job"]["id"]
        # measure once the trainer searches (TensorFlow imported, features built)
        wait_for(lambda: svc.mget(f"/train/{job_id}")[1]["job"]["progress"].get("candidate"), 300,
                 "the search to start", interval=0.1)
        busy = gen.run(svc.port, single, serving.CONC_LATENCY, dur)
        job = svc.mget(f"/train/{job_id}")[1]["job"]
        out["single_c8"] = {"idle_p99_ms": idle["p99_ms"], "training_p99_ms": busy["p99_ms"],
                            "idle_rps": round(idle["rps"]), "training_rps": round(busy["rps"]),
                            "training_still_running_at_end": job["state"] == "running",
                            "errors": idle["errors"] + busy["errors"]}
        wait_for(lambda: svc.mget(f"/train/{job_id}")[1]["job"]["state"] != "running", 600, "auto2")
        # idle again after the job: the lower of the two idle p99s is the
        # baseline (a stray spike from other work on the machine must not
        # flatter the ratio)
        idle2 = gen.run(svc.port, single, serving.CONC_LATENCY, dur)
        out["single_c8"]["idle_p99_runs_ms"] = [idle["p99_ms"], idle2["p99_ms"]]
        out["single_c8"]["idle_p99_ms"] = min(idle["p99_ms"], idle2["p99_ms"])
        out["single_c8"]["errors"] += idle2["errors"]
    finally:
        svc.stop()
    report(out)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def report(out: dict[str, Any]) -> None:
    t = out["batch256_texts_per_s"]
    s = out["single_c8"]
    ratio_t = t["auto"] / t["bow"]
    ratio_p = s["training_p99_ms"] / s["idle_p99_ms"]
    print(json.dumps(out, indent=1))
    print()
    print(f"{'measure':52} {'auto':>10} {'baseline':>10} {'ratio':>6}")
    print(f"{'texts/s, 256 texts/request, c=4 (auto vs bow)':52} {t['auto']:>10} {t['bow']:>10} "
          f"{ratio_t:>6.2f}")
    ratio_w = t["auto_word"] / t["bow"]
    print(f"{'  the same, auto with views [word] vs bow':52} {t['auto_word']:>10} {t['bow']:>10} "
          f"{ratio_w:>6.2f}  {'PASS' if ratio_w >= 0.8 else 'FAIL'} (>= 0.8)")
    print(f"{'single-text p99 ms, c=8 (auto training vs idle)':52} {s['training_p99_ms']:>10.1f} "
          f"{s['idle_p99_ms']:>10.1f} {ratio_p:>6.2f}  {'PASS' if ratio_p <= P99_TARGET else 'FAIL'}"
          f" (<= {P99_TARGET})")
    print(f"single-text req/s idle {s['idle_rps']}, during training {s['training_rps']}; training "
          f"still running at the end of the window: {s['training_still_running_at_end']}")
    a = out["auto_model"]
    print(f"auto model: {a['chosen']}; train {a['train_s']:.1f} s, export {a['export_s']:.1f} s, "
          f"job {a['job_elapsed_s']:.1f} s; bow train {out['bow_model']['train_s']:.1f} s")
    w = out["auto_word_model"]
    print(f"auto model with views [word]: {w['chosen']}; train {w['train_s']:.1f} s")


if __name__ == "__main__":
    raise SystemExit(main())
