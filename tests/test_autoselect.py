"""architecture "auto": the search, its report, budget, reproducibility, and
safe-mode loading of every model family it can produce.

Real scikit-learn and TensorFlow on tiny data in this process (as
test_textmodel does); the reloads happen in a fresh interpreter that only
imports model_worker.textmodel, exactly what a serving worker does. The
end-to-end path through the service is in test_training_auto.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "data" / "demo" / "sentiment_zh.jsonl"

# A three-label English set: topic words inside varied sentences.
_TOPICS = {
    "sport": ["football match", "tennis final", "the striker scored", "marathon runners", "league table",
              "the goalkeeper saved", "olympic swimming", "basketball playoffs", "cricket innings",
              "cycling race", "boxing title fight", "rugby scrum"],
    "tech": ["new smartphone chip", "software update", "laptop battery", "cloud servers", "open source code",
             "the compiler crashed", "wireless router", "graphics card drivers", "database backup",
             "encryption keys", "operating system kernel", "mobile app release"],
    "food": ["chocolate cake recipe", "fresh pasta sauce", "spicy noodle soup", "grilled salmon",
             "vegetable curry", "the bakery bread", "cheese and wine", "sushi restaurant", "apple pie",
             "roast chicken dinner", "green tea dessert", "pancakes with honey"],
}
_FRAMES = ["news about {}", "{} today", "people talk about the {}", "i read about {} this week",
           "a long story on {} and more"]


def english() -> tuple[list[str], list[str]]:
    texts, labels = [], []
    for label, topics in _TOPICS.items():
        for i, topic in enumerate(topics):
            for j in range(2):
                texts.append(_FRAMES[(i + j) % len(_FRAMES)].format(topic))
                labels.append(label)
    return texts, labels


def chinese(n: int) -> tuple[list[str], list[str]]:
    with open(DEMO, encoding="utf-8") as fh:
        rows = [json.loads(line) for _, line in zip(range(n), fh)]
    return [r["text"] for r in rows], [r["label"] for r in rows]


def test_auto_params_validated():
    from model_worker.params import DEFAULT_PARAMS, ParamError, validate_params

    assert DEFAULT_PARAMS["architecture"] == "auto"
    p = validate_params({"time_budget_s": 5, "folds": 3, "seed": 7})
    assert p["time_budget_s"] == 5.0 and p["folds"] == 3 and p["seed"] == 7
    for field, bad in [("time_budget_s", 0), ("time_budget_s", "60"), ("folds", 1), ("folds", 11),
                       ("folds", 2.5), ("include_networks", "yes"), ("views", []), ("views", "word"),
                       ("views", ["word", "words"]), ("views", ["char", "char"]), ("views", [1])]:
        with pytest.raises(ParamError) as err:
            validate_params({field: bad})
        assert err.value.field == field
    assert validate_params({})["views"] == ["word", "char", "punct"]
    assert validate_params({})["folds"] is None and validate_params({"folds": None})["folds"] is None


def test_default_folds_by_size():
    """folds null: 5, or 3 from FEW_FOLDS_FROM texts on; an explicit number is kept."""
    from model_worker import autoselect
    from model_worker.params import FEW_FOLDS_FROM, validate_params

    texts, labels = chinese(FEW_FOLDS_FROM)
    assert len(texts) == FEW_FOLDS_FROM
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    for n, params, want in ((FEW_FOLDS_FROM, {}, 3), (FEW_FOLDS_FROM - 1, {}, 5),
                            (FEW_FOLDS_FROM, {"folds": 5}, 5), (200, {"folds": 4}, 4)):
        search = autoselect.Search(texts[:n], y[:n], len(names), validate_params({**params, "views": ["word"]}),
                                   "char", time.monotonic(), None, None)
        assert len(search.folds) == want, (n, params)
    assert validate_params({"views": ["punct", "word"]})["views"] == ["word", "punct"]


@pytest.mark.parametrize("views", [["word"], ["char"], ["word", "punct"]])
def test_search_keeps_to_the_allowed_views(views):
    """`views` bounds the search: no candidate, and so no served branch, uses another view."""
    from model_worker import textmodel

    texts, labels = english()
    result = textmodel.train_model(texts, labels, {"time_budget_s": 3600, "folds": 2, "seed": 5, "views": views})
    report = result.report
    assert report["views_allowed"] == views
    tried = {v for c in report["candidates"] + report["pruned"] for v in c["views"]}
    assert tried == set(views)  # every allowed view was tried, no other one
    assert set(report["views"]) == set(views)
    assert set(report["chosen"]["members"][0]["views"]) <= set(views)
    names = {layer.name for layer in result.model.layers}
    assert not {f"vectorizer_{v}" for v in ("word", "char", "punct") if v not in views} & names
    assert report["skipped"] == [{"name": n, "reason": "include_networks is false"} for n in ("bow", "cnn")]


@pytest.fixture(scope="module")
def english_result():
    from model_worker import textmodel

    texts, labels = english()
    return texts, labels, textmodel.train_model(texts, labels, REPRODUCIBLE)


# The longest budget the parameters take: far above the test's timeout, so it never
# binds and the search (and so the model) does not depend on how fast this machine is.
REPRODUCIBLE = {"time_budget_s": 3600, "folds": 3, "seed": 11}


def test_report_fields(english_result):
    texts, labels, result = english_result
    report, metrics = result.report, result.metrics
    assert result.labels == ["food", "sport", "tech"]
    assert report["method"] == "auto" and report["folds"] == 3 and report["seed"] == 11
    assert report["tokenize"] == "word" and set(report["views"]) == {"word", "char", "punct"}
    # evaluated in full, or stopped early by racing: every planned candidate ran
    assert len(report["candidates"]) + len(report["pruned"]) >= 8
    for pruned in report["pruned"]:
        assert pruned["folds_scored"] < 3
        assert pruned["partial_macro_f1"] < pruned["best_on_same_folds"] - 0.03
    for cand in report["candidates"]:
        assert 0.0 <= cand["cv_macro_f1"] <= 1.0 and cand["cv_std"] >= 0 and cand["seconds"] >= 0
        assert len(cand["fold_scores"]) == 3
        assert cand["learner"] in ("svm", "nbsvm", "lr")
    # the screen: one learner over the single views, then words + the better character view
    screen = [h["name"].split("/")[0] for h in result.history[:4]]
    assert screen[:3] == ["word", "char", "punct"]
    # punct goes on only when it screened better than char by the margin
    from model_worker import autoselect
    char, punct = (-1.0 if h.get("pruned") else h["score"] for h in result.history[1:3])
    want = "word+punct" if punct > char + autoselect._PUNCT_MARGIN else "word+char"
    assert screen[3] == want, result.history[:4]
    best = max(c["cv_macro_f1"] for c in report["candidates"])
    chosen = report["chosen"]
    assert chosen["members"] and all(m["temperature"] > 0 for m in chosen["members"])
    if not report["ensemble"].get("kept"):
        assert chosen["cv_macro_f1"] == pytest.approx(best, abs=1e-4)
    # networks were not asked for: reported as skipped, with the reason
    assert {s["name"] for s in report["skipped"]} == {"bow", "cnn"}
    oof = report["out_of_fold"]
    conf = np.array(oof["confusion_matrix"]["rows"])
    assert oof["confusion_matrix"]["labels"] == result.labels
    assert conf.sum() == len(texts) and conf.shape == (3, 3)
    assert np.trace(conf) / len(texts) == pytest.approx(oof["accuracy"], abs=1e-3)
    for name in result.labels:
        row = oof["per_label"][name]
        assert {"precision", "recall", "f1", "support"} <= row.keys() and row["support"] == 24
    cal = report["calibration"]
    assert cal["bins"] == 15 and 0 <= cal["ece_after"] <= 1 and 0 <= cal["ece_before"] <= 1
    # T minimises out-of-fold NLL and T = 1 is a candidate: never worse
    assert cal["nll_after"] <= cal["nll_before"] + 1e-3
    # the metrics other code reads are there, from the same predictions
    assert metrics["macro_f1"] == oof["macro_f1"] and metrics["measured_on"] == "cross_validation"
    assert metrics["accuracy"] > 0.6  # chance is 1/3; unseen topic words cap it
    # progress rows, one per candidate evaluated
    assert [h["candidate"] for h in result.history] == sorted(h["candidate"] for h in result.history)
    assert all({"candidate", "of", "best_score", "score"} <= h.keys() for h in result.history)


def test_same_seed_same_model(english_result):
    """Trained again, with its folds fitted two at a time (foldpool, one
    process each: what training.threads 2 gives a trainer), the search
    scores every candidate on every fold the same and builds the same model."""
    from model_worker import foldpool, textmodel

    texts, labels, first = english_result
    assert first.report["budget_bound"] is False  # see REPRODUCIBLE
    assert first.report["fold_processes"] == 1
    foldpool.set_processes(2)
    try:
        again = textmodel.train_model(texts, labels, REPRODUCIBLE)
    finally:
        foldpool.set_processes(1)
    assert again.report["fold_processes"] == 2
    assert [(c["name"], c["fold_scores"]) for c in again.report["candidates"]] == \
        [(c["name"], c["fold_scores"]) for c in first.report["candidates"]]
    assert [(p["name"], p["folds_scored"], p["partial_macro_f1"]) for p in again.report["pruned"]] == \
        [(p["name"], p["folds_scored"], p["partial_macro_f1"]) for p in first.report["pruned"]]
    assert again.report["chosen"] == first.report["chosen"]
    probe = texts[::7] + ["an unseen text about tennis and noodles"]
    np.testing.assert_allclose(textmodel.make_predict_fn(again.model)(probe),
                               textmodel.make_predict_fn(first.model)(probe), atol=1e-6)


def test_the_learning_curve_and_the_refit_fit_in_processes_as_alone():
    """After the search, the learning curve's fits (each member on 3/4 of
    each fold) and the final refit of an ensemble's members go through the
    fold pool too, training.threads at once: the same numbers as one at a
    time, in the same order."""
    import time

    from model_worker import autoselect, foldpool, scoring
    from model_worker.params import validate_params

    texts, labels = chinese(600)
    names = sorted(set(labels))
    y = np.array([names.index(x) for x in labels])
    search = autoselect.Search(texts, y, len(names), validate_params({"time_budget_s": 3600, "folds": 3,
                                                                      "views": ["char"]}),
                               "char", time.monotonic(), None, None)
    members = [search.run(autoselect.Candidate(("char",), learner, c), i, 2)
               for i, (learner, c) in enumerate([("svm", 1.0), ("lr", 10.0)], 1)]
    assert all(m is not None for m in members)
    got = {}
    for n in (1, 2):
        foldpool.set_processes(n)
        try:
            small, note = autoselect.learning_curve(search, members, [1.0, 1.0])  # type: ignore[arg-type]
            model = autoselect.final_model(search, [m.candidate for m in members], [1.0, 0.5])  # type: ignore[union-attr]
        finally:
            foldpool.set_processes(1)
        assert note["applied"] is True, note
        got[n] = (small, scoring.make_predict_fn(model)(texts[::37]))
    for a, b in zip(got[1][0], got[2][0]):
        np.testing.assert_allclose(a, b, atol=1e-9)
    assert not np.allclose(got[1][0][0], got[1][0][1])  # two members, two curves
    np.testing.assert_allclose(got[1][1], got[2][1], atol=1e-6)


def test_the_budget_counts_rounds_of_folds_fitted_at_once():
    """With two folds fitted at a time, 5 folds take 3 rounds: after the
    first result (one round, 10 s) two more rounds are left, not four fits;
    one at a time, four fits."""
    from model_worker.autoselect import _left_s

    assert _left_s(10.0, 1, 5, 2) == 20.0  # folds 1-4: the rest of round 1, rounds 2 and 3
    assert _left_s(10.0, 2, 5, 2) == 20.0
    assert _left_s(20.0, 3, 5, 2) == 10.0
    assert _left_s(20.0, 4, 5, 2) == 10.0
    assert _left_s(10.0, 1, 5, 1) == 40.0  # one at a time: as before
    assert _left_s(12.0, 3, 3, 2) == 0.0


def test_the_fold_pool_runs_folds_in_processes_in_order_and_stops_them(monkeypatch):
    """foldpool.ordered with 2 processes: every job in a child of its own,
    two at once, the results in the jobs' order whichever ends first; a
    job is built only when a process frees for it; a child's exception
    comes back as a RuntimeError naming it, in its turn; closing early
    kills the children still running; every child is reaped."""
    import os
    import select

    from model_worker import foldpool

    parent = os.getpid()
    first, second = os.pipe(), os.pipe()
    built: list[int] = []

    def job(k: int):
        built.append(k)

        def run() -> np.ndarray:
            if k == 0:  # ends only when job 1, running at the same time, has said so
                assert select.select([first[0]], [], [], 60)[0], "the second job never ran beside the first"
                assert os.read(first[0], 1) == b"1"
            if k == 1:
                os.write(first[1], b"1")
            return np.array([k, os.getpid(), os.getppid()])
        return run

    def jobs(n: int):
        for k in range(n):
            yield job(k)

    foldpool.set_processes(2)
    try:
        results = foldpool.ordered(jobs(5))
        got = [next(results)]
        # two at once: a job is built when a process frees, so by the first
        # result (two ended at most) the fifth is not
        assert built[:2] == [0, 1] and len(built) <= 4
        got += list(results)
        assert [int(g[0]) for g in got] == [0, 1, 2, 3, 4]
        assert all(int(g[2]) == parent and int(g[1]) != parent for g in got)
        children = [int(g[1]) for g in got]
        assert len(set(children)) == 5

        def fails() -> np.ndarray:
            raise ValueError("no convergence at all")

        def stuck() -> np.ndarray:  # runs until it is killed
            os.write(second[1], os.getpid().to_bytes(4, "little"))
            select.select([], [], [])
            return np.zeros(1)
        results = foldpool.ordered(iter([lambda: np.zeros(1), fails]))
        assert next(results).tolist() == [0.0]
        with pytest.raises(RuntimeError, match="no convergence at all"):
            next(results)
        results = foldpool.ordered(iter([lambda: np.ones(1), stuck, lambda: np.zeros(1)]))
        assert next(results).tolist() == [1.0]
        children.append(int.from_bytes(os.read(second[0], 4), "little"))  # the stuck one has started
        results.close()  # and is killed
        for pid in children:  # every child reaped
            with pytest.raises(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    finally:
        foldpool.set_processes(1)
        for fd in (*first, *second):
            os.close(fd)
    # a fork that fails (memory, process limits) runs that fold here instead
    real_fork, forks = os.fork, []

    def fork_once_fails() -> int:
        forks.append(1)
        if len(forks) == 2:
            raise OSError(11, "Resource temporarily unavailable")
        return real_fork()
    monkeypatch.setattr(os, "fork", fork_once_fails)
    foldpool.set_processes(2)
    try:
        got = list(foldpool.ordered(iter([lambda: np.array([os.getpid()])] * 3)))
    finally:
        foldpool.set_processes(1)
        monkeypatch.undo()
    where = [int(g[0]) for g in got]
    assert where[1] == parent and where[0] != parent and where[2] != parent
    made: list[int] = []

    def here(k: int):
        made.append(k)
        return lambda: np.array([k, os.getpid()])
    one = foldpool.ordered(here(k) for k in range(3))  # one process: each job here, when its turn comes
    assert next(one).tolist() == [0, parent] and made == [0]
    one.close()


def test_time_budget_honoured():
    from model_worker import textmodel

    texts, labels = chinese(3000)
    budget = 6.0
    result = textmodel.train_model(texts, labels, {"time_budget_s": budget})
    report = result.report
    assert report["budget_bound"] is True
    reasons = [s["reason"] for s in report["skipped"] if s["name"] not in ("bow", "cnn")]
    assert reasons and all("time budget" in r for r in reasons)
    assert 1 <= len(report["candidates"]) < 13
    # the search stopped because of the budget (not by running out of
    # candidates): what it skipped says so. How long it ran is wall-clock time
    # on a shared machine, not asserted here.
    assert report["seconds"]["search"] > 0


def test_punctuation_view_when_punctuation_decides():
    """Labels told apart only by the end mark, dealt out in turn over texts whose
    words say nothing about it: the views that strip punctuation see no
    signal; the punct view sees "? ", "! " and ". "."""
    from model_worker import textmodel

    words, _ = english()
    marks = [("ask", "?"), ("shout", "!"), ("state", ".")]
    texts = [text + marks[i % 3][1] for i, text in enumerate(words)]
    labels = [marks[i % 3][0] for i in range(len(words))]
    result = textmodel.train_model(texts, labels, {"time_budget_s": 3600, "folds": 3, "seed": 3})
    report = result.report
    best = max(report["candidates"], key=lambda c: c["cv_macro_f1"])
    assert "punct" in best["views"] and best["cv_macro_f1"] > 0.85
    assert all(c["cv_macro_f1"] < 0.6 for c in report["candidates"] if "punct" not in c["views"])
    assert all("punct" in m["views"] for m in report["chosen"]["members"])
    probs = textmodel.make_predict_fn(result.model)(["who won the tennis final?", "the chocolate cake!",
                                                      "a laptop battery."])
    assert [result.labels[i] for i in np.argmax(probs, axis=1)] == ["ask", "shout", "state"]


LOAD_ALL = """
import json, sys
import keras
import model_worker.textmodel as tm
out = {}
for path in json.loads(sys.argv[1]):
    model = keras.saving.load_model(path, safe_mode=True)
    out[path] = tm.make_predict_fn(model)(json.loads(sys.argv[2])).tolist()
print(json.dumps(out))
"""


def test_every_family_loads_in_safe_mode(tmp_path):
    """Each view set, each learner, an ensemble and the calibrated networks."""
    from model_worker import autoselect, textmodel
    from model_worker.autoselect import Candidate
    from model_worker.params import validate_params

    texts, labels = english()
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    params = validate_params({"folds": 2})
    search = autoselect.Search(texts, y, len(names), params, "word", time.monotonic(), None, None)
    families = {
        "word_svm": [Candidate(("word",), "svm", 1.0)],
        "char_nbsvm": [Candidate(("char",), "nbsvm", 0.3)],
        "union_lr": [Candidate(("word", "char"), "lr", 10.0)],
        "punct_svm": [Candidate(("word", "punct"), "svm", 1.0)],
        "ensemble": [Candidate(("word",), "nbsvm", 0.1), Candidate(("word", "char"), "svm", 1.0)],
    }
    probe = ["tennis final today", "a new laptop?!", "noodle\tsoup  recipe: 100%", "完全 unseen 文本。"]
    expected, paths = {}, []
    for name, members in families.items():
        model = autoselect.final_model(search, members, [0.5] * len(members))
        path = str(tmp_path / f"{name}.keras")
        model.save(path)
        paths.append(path)
        expected[path] = textmodel.make_predict_fn(model)(probe)
    net_params = {"epochs": 2, "max_tokens": 500, "validation_split": 0.0, "sequence_length": 16,
                  "embedding_dim": 8}
    for arch in ("bow", "cnn"):
        model = textmodel.calibrated_network(texts, labels, {**net_params, "architecture": arch}, 2.0)
        path = str(tmp_path / f"{arch}.keras")
        model.save(path)
        paths.append(path)
        expected[path] = textmodel.make_predict_fn(model)(probe)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", LOAD_ALL, json.dumps(paths), json.dumps(probe)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for path in paths:
        probs = np.array(got[path])
        assert probs.shape == (len(probe), 3)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(probs, expected[path], atol=1e-6)


def test_risk_coverage_carried_to_the_final_models_size():
    """From 500 texts on, the chosen members are fitted once more on 3/4 of each
    fold: the report's risk-coverage rows are carried one step along that curve
    (the fold models' own figures kept as cv_*), accuracy_low is the one-sided
    95 % Wilson bound under each accuracy, and the served temperature is the
    fold models' one moved along the curve by at most 1.25x."""
    from model_worker import autoselect, textmodel

    texts, labels = chinese(1200)
    result = textmodel.train_model(texts, labels, {"time_budget_s": 30, "views": ["char"]})
    report = result.report
    note = report["risk_coverage_method"]
    assert note["applied"] is True, note
    k = report["folds"]
    assert note["factor"] == pytest.approx(np.log(k / (k - 1)) / np.log(1 / 0.75), abs=1e-3)
    served, fitted = report["calibration"]["temperature"], report["calibration"]["temperature_cv"]
    assert [m["temperature"] for m in report["chosen"]["members"]] == served
    for t, t0 in zip(served, fitted):
        assert t0 / 1.25 - 1e-3 <= t <= t0 * 1.25 + 1e-3
    rows = report["risk_coverage"]
    assert [r["threshold"] for r in rows] == [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    for r in rows:
        assert {"coverage", "accuracy", "accuracy_low", "cv_coverage", "cv_accuracy", "answered"} <= r.keys()
        if r["accuracy"] is not None:
            n = r["coverage"] * len(texts)
            assert r["accuracy_low"] == pytest.approx(autoselect.wilson_low(r["accuracy"], n), abs=1e-4)
            assert r["accuracy_low"] < r["accuracy"]
    # the bound: 90 % of 100 -> 0.8396 (one-sided 95 %, Wilson); tighter with more texts
    assert autoselect.wilson_low(0.9, 100) == pytest.approx(0.8396, abs=5e-4)
    assert autoselect.wilson_low(0.9, 1000) > autoselect.wilson_low(0.9, 100)
    # under 500 texts the curve is not drawn, and it says why
    small = textmodel.train_model(texts[:300], labels[:300], {"time_budget_s": 10, "views": ["char"]})
    assert small.report["risk_coverage_method"]["applied"] is False
    assert "500" in small.report["risk_coverage_method"]["why"]
    assert small.report["calibration"]["temperature"] == small.report["calibration"]["temperature_cv"]
