"""Serving cost of auto's pretrained view: worker memory (PSS) and throughput.

    .venv/bin/python bench/pretrained_cost.py [--set debian_en] [--n 1000] [--budget 30]

Builds `auto`'s served graph from the set's first --n training texts for the
same learner (svm C=1) on word + char with and without the pretrained view
(autoselect.final_model, as the trainer does), saves both as .keras, then for each one starts a fresh interpreter that does what a
serving worker does (imports model_worker.textmodel, loads the model in
safe mode, predicts) and reports its PSS and USS after warm-up (USS, the process's own pages,
is the steadier of the two on a machine where other TensorFlow processes
share the libraries' pages), texts/s at batch 1
and at batch 256 (make_predict_fn, one thread), and the artifact's size.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CHILD = r"""
import json, os, sys, time
import psutil, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
from model_worker import textmodel
texts = json.load(open(sys.argv[2]))
before = psutil.Process().memory_full_info().pss
model = keras.saving.load_model(sys.argv[1], safe_mode=True)
predict = textmodel.make_predict_fn(model)
predict(texts[:256]); predict(texts[:1])
def rate(batch, seconds=2.0):
    chunk = (texts * (batch // len(texts) + 1))[:batch]
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        predict(chunk); done += batch
    return done / (time.perf_counter() - t0)
r1, r256 = rate(1), rate(256)
r1, r256 = max(r1, rate(1)), max(r256, rate(256))
info = psutil.Process().memory_full_info()
pss = info.pss
bad = [p for p in ("tokenizers", "safetensors", "wordfreq", "wordllama") if p in sys.modules]
print(json.dumps({"pss_mb": round(pss / 2**20, 1), "uss_mb": round(info.uss / 2**20, 1), "pss_model_mb": round((pss - before) / 2**20, 1),
                  "texts_per_s_1": round(r1), "texts_per_s_256": round(r256), "imported": bad}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="debian_en")
    ap.add_argument("--n", type=int, default=1000)
    args = ap.parse_args()
    import datasets

    ds = datasets.load(args.set)
    texts, labels = ds.train_texts[:args.n], ds.train_labels[:args.n]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.json")
        Path(probe).write_text(json.dumps(ds.test_texts[:512]))
        import time

        import numpy as np

        from model_worker import autoselect
        from model_worker.params import validate_params

        names = sorted(set(labels))
        y = np.array([names.index(x) for x in labels])
        t0 = time.monotonic()
        search = autoselect.Search(texts, y, len(names), validate_params({}), "word", time.monotonic(), None, None)
        print(f"features (with the word table) {time.monotonic() - t0:.1f}s; table {search.pretrained.get('words')} words",
              flush=True)
        for name, views in (("with pretrained", ("word", "char", "pretrained")), ("without", ("word", "char"))):
            model = autoselect.final_model(search, [autoselect.Candidate(views, "svm", 1.0)], [1.0])
            path = os.path.join(tmp, name.replace(" ", "_") + ".keras")
            model.save(path)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
            got = subprocess.run([sys.executable, "-c", CHILD, path, probe], capture_output=True, text=True,
                                 env=env, check=True)
            row = json.loads(got.stdout.strip().splitlines()[-1])
            row["views"] = "+".join(views)
            row["artifact_mb"] = round(os.path.getsize(path) / 2**20, 1)
            out[name] = row
            print(name, json.dumps(row), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
