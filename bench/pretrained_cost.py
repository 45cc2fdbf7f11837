"""Serving cost of auto's pretrained view: worker memory (PSS, USS) and throughput.

    .venv/bin/python -m bench.pretrained_cost [--set debian_en] [--n 1000] [--rounds 3] [--vector-table] [--first-layout]
                                              [--folded] [--engine lean|keras] [--fresh 1000]

Builds `auto`'s served graph from the set's first --n training texts for the
same learner (svm C=1) on word + char with and without the pretrained view
(autoselect.final_model, as the trainer does: the view's linear map folded
into its table, layers.PretrainedLogits; with --vector-table also the view
as a vector table and a SparseLinear, with --first-layout in its first
layout, as versions saved before hold them; with --folded also the view as
versions trained before case was kept build it: lowercase words, punctuation
dropped, one lookup, the baseline of the case-kept view's cost), saves each
as .keras, then, --rounds times, the models taking turns, starts a fresh
interpreter for each that does what a serving worker does (imports
model_worker.textmodel, loads the model in safe mode, predicts, gives the
heap's freed pages back after the load and after the batches, as
model_worker.worker.release_free_memory does when idle) and reports
its PSS and USS after warm-up (USS also after the first single-text call,
before any batch: what a model holds loaded, without the batches' scratch
memory that the allocator keeps) (USS, the process's own pages, is the steadier
of the two on a machine where other TensorFlow processes share the
libraries' pages), texts/s at batch 1 (each probe text alone, in turn), again at batch 1
on --fresh x 2 texts the process has not seen (each once: a pretrained
view's cache of words meets new words, as a serving worker does) and at
batch 256 (make_predict_fn, one thread), and the artifact's size. Prints the medians, and each model against
the one without the view (today's auto) measured in the same run. With
the lean engine it then also times the new texts text by text in one
process: each text through every model in turn, CPU time summed per model
(steadier than the rounds' rates on a noisy machine), against the model
without the view and, with --folded, the folded one.

--engine lean (the default, what workers serve from): each model's lean plan
is exported beside it as the trainer does (model_worker/lean.py, checked
against the Keras model's scores) and the fresh interpreter serves from the
plan alone, without TensorFlow; --engine keras loads the .keras model.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the frequent English words of the folded view of before (the baseline)
FOLDED_FREQUENT_WORDS = 30_000

# what a serving worker does to load the model, per engine: defines
# `predict`, `before` (PSS before the load) and `unwanted` (modules the
# process must not have imported)
KERAS_LOAD = r"""
import json, os, sys, time
import psutil, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
from model_worker import textmodel, worker
worker.fix_malloc_thresholds()  # as worker.main does first
before = psutil.Process().memory_full_info().pss
model = keras.saving.load_model(sys.argv[1], safe_mode=True)
predict = textmodel.make_predict_fn(model)
unwanted = ("tokenizers", "safetensors", "wordfreq", "wordllama")
"""

# a lean worker: the plan alone, no TensorFlow
LEAN_LOAD = r"""
import json, os, sys, time
import psutil
from model_worker import lean, worker
lean.text_ops()  # the tables, as the zygote loads them before a worker forks
worker.fix_malloc_thresholds()  # as worker.main does first
before = psutil.Process().memory_full_info().pss
predict = lean.load(os.path.dirname(sys.argv[1])).predict
unwanted = ("tensorflow", "keras", "tokenizers", "safetensors", "wordfreq", "wordllama")
"""

# then the same measurements for both
MEASURE = r"""
texts = json.load(open(sys.argv[2]))
predict(texts[:1])
worker.release_free_memory()  # as the worker does after its load's warm-up
uss_single = psutil.Process().memory_full_info().uss
predict(texts[:256])
def rate(batch, seconds=2.0):
    # batches of `batch` texts in turn, through all the probe texts (single
    # texts: each text alone, not one text again and again)
    many = texts * (batch // len(texts) + 1)
    chunks = [many[i:i + batch] for i in range(0, len(many) - batch + 1, batch)]
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        predict(chunks[done // batch % len(chunks)]); done += batch
    return done / (time.perf_counter() - t0)
r1, r256 = rate(1), rate(256)
r1, r256 = max(r1, rate(1)), max(r256, rate(256))
# texts this worker has not seen, one at a time, each once: a worker that
# has served the probe texts meets new ones (new words: a pretrained view's
# cache misses), the halves in turn, the faster kept as above
fresh = json.load(open(sys.argv[3]))
def once(part):
    t0 = time.perf_counter()
    for t in part:
        predict([t])
    return len(part) / (time.perf_counter() - t0)
r1_new = max(once(fresh[:len(fresh) // 2]), once(fresh[len(fresh) // 2:]))
worker.release_free_memory()  # as the worker does when idle after a large call
info = psutil.Process().memory_full_info()
pss = info.pss
bad = [p for p in unwanted if p in sys.modules]
print(json.dumps({"pss_mb": round(pss / 2**20, 1), "uss_mb": round(info.uss / 2**20, 1), "pss_model_mb": round((pss - before) / 2**20, 1),
                  "uss_single_mb": round(uss_single / 2**20, 1),
                  "texts_per_s_1": round(r1), "texts_per_s_1_new": round(r1_new), "texts_per_s_256": round(r256),
                  "imported": bad}))
"""

# lean plans only: every model in one process, each new text through every
# model in turn (the order rotating), CPU time summed per model. The rounds
# above run each model alone, as workers do, but on a noisy machine their
# rates move by tens of percent from round to round; here the machine's
# drift falls on every model alike, text by text. Each model runs with CPU
# caches the others have just used: lower rates than a worker's, the same
# for all.
TEXT_BY_TEXT = r"""
import json, sys, time
from model_worker import lean, worker
lean.text_ops()
worker.fix_malloc_thresholds()
folders = json.loads(sys.argv[1])
plans = {name: lean.load(folder) for name, folder in folders.items()}
for p in plans.values():
    for t in json.load(open(sys.argv[2])):
        p.predict([t])
names, spent = list(plans), dict.fromkeys(plans, 0.0)
fresh = json.load(open(sys.argv[3]))
for j, t in enumerate(fresh):
    for i in range(len(names)):
        name = names[(i + j) % len(names)]
        t0 = time.thread_time()
        plans[name].predict([t])
        spent[name] += time.thread_time() - t0
print(json.dumps({name: len(fresh) / spent[name] for name in names}))
"""


@contextlib.contextmanager
def layout(kind: str):
    """The view's served layout while building: "fused" (the table holds the
    linear map: layers.PretrainedLogits, what the trainer builds), "vector"
    (the packed vector table and a SparseLinear, as versions saved before the
    fused table hold it) or "first" (two Embeddings, the first versions)."""
    from model_worker import pretrained

    if kind == "fused":
        yield
        return
    orig_layer, orig_fusable = pretrained.PretrainedView.layer, pretrained.PretrainedView.fusable

    def layer(self, standardized: bool = False):
        lay = pretrained.PretrainedEmbedding(len(self.table.words), self.table.sums.shape[1],
                                             None if standardized else self.standardize, self.scale,
                                             packed=False, l2=self.l2, name=f"vectorizer_{self.name}")
        lay.set_table(self.table)
        return lay

    pretrained.PretrainedView.fusable = lambda self, units: False
    if kind == "first":
        pretrained.PretrainedView.layer = layer
    try:
        yield
    finally:
        pretrained.PretrainedView.layer, pretrained.PretrainedView.fusable = orig_layer, orig_fusable


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="debian_en")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--keep", metavar="DIR", help="save the models and the probe texts in DIR (kept)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes a model, taking turns")
    ap.add_argument("--vector-table", action="store_true",
                    help="also the view as a vector table and a SparseLinear, as versions saved before the "
                         "fused table hold it")
    ap.add_argument("--folded", action="store_true",
                    help="also the view as trained before case was kept (lowercase words, one lookup): "
                         "the case-kept view's baseline")
    ap.add_argument("--first-layout", action="store_true",
                    help="also the view in its first layout (two Embeddings), as the first versions hold it")
    ap.add_argument("--fresh", type=int, default=1000,
                    help="texts in each half of the single-text pass over texts not sent before")
    ap.add_argument("--engine", choices=("lean", "keras"), default="lean",
                    help="serve each model from its lean plan (default, as workers do) or through Keras")
    args = ap.parse_args()
    from bench import datasets

    ds = datasets.load(args.set)
    texts, labels = ds.train_texts[:args.n], ds.train_labels[:args.n]
    out = {}
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as tmp:
        os.makedirs(tmp, exist_ok=True)  # --keep's folder, made when it is new
        probe = os.path.join(tmp, "probe.json")
        Path(probe).write_text(json.dumps(ds.test_texts[:512]))
        fresh = os.path.join(tmp, "fresh.json")  # never sent before the single-text pass over them
        Path(fresh).write_text(json.dumps((ds.test_texts[512:] + ds.train_texts[args.n:])[:2 * args.fresh]))
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
        folded = None
        if args.folded:  # the same search's view, built as before case was kept
            import scipy.sparse as sp

            from model_worker import autofeatures, pretrained

            folded = autoselect.Search(texts, y, len(names), validate_params({}), "word", time.monotonic(), None, None)
            # the frequent words the folded view took (30,000), whatever auto's view takes now
            view, feats = pretrained.fit_view(texts, n_frequent=FOLDED_FREQUENT_WORDS, standardize="word")
            folded.view_defs["pretrained"] = view  # type: ignore[assignment]
            folded.counts["pretrained"] = autofeatures.Counts(sp.csr_matrix(feats.astype(np.float64)),
                                                              view.vocabulary())
            print(f"tables: case kept {search.pretrained.get('words')} words, folded {len(view.table.words)} words",
                  flush=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
        paths = {}
        for name, views, kind in (("with pretrained", ("word", "char", "pretrained"), "fused"),
                                  ("with pretrained, folded (before)", ("word", "char", "pretrained"), "folded"),
                                  ("with pretrained, vector table", ("word", "char", "pretrained"), "vector"),
                                  ("with pretrained, first layout", ("word", "char", "pretrained"), "first"),
                                  ("without", ("word", "char"), "fused")):
            if ((kind == "vector" and not args.vector_table) or (kind == "first" and not args.first_layout)
                    or (kind == "folded" and folded is None)):
                continue
            with layout("fused" if kind == "folded" else kind):
                model = autoselect.final_model(folded if kind == "folded" and folded is not None else search,
                                               [autoselect.Candidate(views, "svm", 1.0)], [1.0])
            folder = os.path.join(tmp, name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""))
            os.makedirs(folder, exist_ok=True)
            paths[name] = os.path.join(folder, "model.keras")
            model.save(paths[name])
            if args.engine == "lean":
                from model_worker import lean, textmodel

                report = lean.export(model, folder, texts, textmodel.make_predict_fn(model))
                if report["engine"] != "lean":
                    raise SystemExit(f"{name}: no lean plan ({report['reason']})")
            plan = os.path.join(folder, "lean.npz")
            out[name] = {"views": "+".join(views), "engine": args.engine,
                         "artifact_mb": round(os.path.getsize(plan if args.engine == "lean" else paths[name]) / 2**20, 1),
                         "runs": []}
        # the variants take turns, --rounds times, each in a fresh process:
        # the machine's drift falls on all of them alike
        for r in range(args.rounds):
            for name, path in paths.items():
                child = (LEAN_LOAD if args.engine == "lean" else KERAS_LOAD) + MEASURE
                got = subprocess.run([sys.executable, "-c", child, path, probe, fresh], capture_output=True, text=True,
                                     env=env, check=True)
                row = json.loads(got.stdout.strip().splitlines()[-1])
                out[name]["runs"].append(row)
                print(f"round {r + 1} {name}: {json.dumps(row)}", flush=True)
        for name in paths:
            runs = out[name].pop("runs")
            out[name].update({k: statistics.median(x[k] for x in runs)
                              for k in ("pss_mb", "uss_mb", "uss_single_mb", "texts_per_s_1", "texts_per_s_1_new",
                                        "texts_per_s_256")})
            out[name]["imported"] = sorted({p for x in runs for p in x["imported"]})
            out[name]["rounds"] = len(runs)
        if args.engine == "lean":
            folders = json.dumps({name: os.path.dirname(path) for name, path in paths.items()})
            got = subprocess.run([sys.executable, "-c", TEXT_BY_TEXT, folders, probe, fresh], capture_output=True,
                                 text=True, env=env, check=True)
            for name, rate in json.loads(got.stdout.strip().splitlines()[-1]).items():
                out[name]["texts_per_s_1_new_text_by_text"] = rate
    base = out["without"]
    print(f"\n{args.set}, {args.n} training texts, {args.engine} engine, medians of {args.rounds} rounds")
    print("| model | artifact MB | PSS MB | USS MB | USS MB before batches | texts/s, single, new texts"
          " | texts/s, single, the probe again | texts/s, batch 256 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in out.items():
        rel = ["", "", "", "", "", ""]
        if row is not base:
            rel = [f" ({row[k] - base[k]:+.1f})" for k in ("pss_mb", "uss_mb", "uss_single_mb")] + \
                  [f" ({row[k] / base[k] - 1:+.1%})" for k in ("texts_per_s_1_new", "texts_per_s_1", "texts_per_s_256")]
        print(f"| {name} | {row['artifact_mb']} | {row['pss_mb']}{rel[0]} | {row['uss_mb']}{rel[1]} | "
              f"{row['uss_single_mb']}{rel[2]} | {row['texts_per_s_1_new']:.0f}{rel[3]} | {row['texts_per_s_1']:.0f}{rel[4]} | "
              f"{row['texts_per_s_256']:.0f}{rel[5]} |")
    if args.engine == "lean":
        key = "texts_per_s_1_new_text_by_text"
        others = [n for n in out if n != "without"]
        print(f"\nsingle new texts, text by text in one process ({2 * args.fresh} texts, CPU time), against "
              + " and ".join(["without"] + [n for n in others if "folded" in n]))
        folded = [n for n in others if "folded" in n]
        print("| model | texts/s | against without |" + "".join(f" against {n} |" for n in folded))
        print("|---|---|---|" + "---|" * len(folded))
        for name, row in out.items():
            rel = [f"{row[key] / out[b][key] - 1:+.1%}" for b in ["without", *[n for n in others if "folded" in n]]]
            print(f"| {name} | {row[key]:.0f} | {' | '.join(rel)} |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
