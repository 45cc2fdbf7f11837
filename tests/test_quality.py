"""Live quality (control/quality.py) and the training profile
(model_worker/profile.py), without TensorFlow.

The figures on known feedback are checked against scikit-learn's; the report
of a model is computed from the real prediction log (state/predlog.py, its
writer process and SQLite file), filled as the service fills it, over a real
store folder with and without profile.json. The same figures through the
real service (POST /predict, POST /feedback, GET /quality, /metrics) are in
tests/test_drift.py.
"""
from __future__ import annotations

import json
import os
import random
import time

import pytest
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score, recall_score

from tests.helpers import ROOT
from control import quality
from model_worker import profile as prof
from state.config import DriftSettings
from state.errors import NotFound

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
CFG = DriftSettings(window=1000, min_texts=200, max_unknown_excess=0.04, max_label_js=0.1,
                    max_top_score_js=0.03, refresh_s=0.0)


def _demo() -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# -- the profile --------------------------------------------------------------------------
def test_ngrams_chinese_by_characters_and_bigrams_other_scripts_by_words():
    assert prof.ngrams("很好用!") == {"很", "好", "用", "很好", "好用"}
    assert prof.ngrams("Great, GREAT product") == {"great", "product"}
    # mixed: words stay whole, no bigram crosses a word or punctuation
    assert prof.ngrams("iPhone很好。真的") == {"iphone", "很", "好", "很好", "真", "的", "真的"}
    assert prof.ngrams("!!! ...") == set()


def test_hashed_set_round_trips():
    hashes = {prof.ngram_hash(g) for g in ("a", "很", "很好", "x" * 50)} | {0, 2 ** 32 - 1}
    assert prof.decode_set(prof.encode_set(hashes)) == frozenset(hashes)
    assert prof.decode_set(prof.encode_set([])) == frozenset()


def test_js_divergence_bounds():
    assert prof.js_divergence([1, 1], [5, 5]) == pytest.approx(0.0)
    assert prof.js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    assert 0 < prof.js_divergence([0.6, 0.4], [0.5, 0.5]) < 0.02
    assert prof.histogram([0.0, 0.05, 0.55, 0.99, 1.0]) == [2, 0, 0, 0, 0, 1, 0, 0, 0, 2]


def test_profile_known_share_is_measured_leave_one_out():
    rows = _demo()[:1000]
    texts, labels = [r["text"] for r in rows], [r["label"] for r in rows]
    p = prof.build(texts, labels, ["neg", "pos"])
    known = prof.decode_set(p["ngrams"]["set"])
    # on the training texts themselves every n-gram is known ...
    assert prof.known_shares(texts[:50], known) == [1.0] * 50
    # ... but the profile's share is leave-one-out: lower, as on unseen texts
    assert 0.7 < p["known_share"]["mean"] < 0.97
    others = [r["text"] for r in _demo()[1000:1500]]
    live = prof.known_shares(others, known)
    assert abs(sum(live) / len(live) - p["known_share"]["mean"]) < 0.03
    share = sum(lab == "pos" for lab in labels) / len(labels)
    assert p["labels"]["train"] == {"neg": pytest.approx(1 - share), "pos": pytest.approx(share)}
    assert p["top_score"] is None  # no held-out predictions given


# -- live figures ---------------------------------------------------------------------------
def test_live_figures_match_scikit_learn():
    rng = random.Random(3)
    names = ["billing", "bug", "sales"]
    truth = [rng.choice(names) for _ in range(300)]
    pred = [t if rng.random() < 0.7 else rng.choice(names) for t in truth]
    pred[:3] = ["refund"] * 3  # a label only ever predicted
    rows = [{"label": p, "truth": t} for p, t in zip(pred, truth)]
    live = quality.live_figures(rows)
    labels = sorted(set(truth) | set(pred))
    assert live["confusion"]["labels"] == labels
    assert live["confusion"]["rows"] == confusion_matrix(truth, pred, labels=labels).tolist()
    assert live["accuracy"] == pytest.approx(accuracy_score(truth, pred), abs=1e-6)
    assert live["macro_f1"] == pytest.approx(
        f1_score(truth, pred, average="macro", labels=labels, zero_division=0), abs=1e-6)
    p = precision_score(truth, pred, average=None, labels=labels, zero_division=0)
    r = recall_score(truth, pred, average=None, labels=labels, zero_division=0)
    for i, name in enumerate(labels):
        assert live["per_label"][name]["precision"] == pytest.approx(p[i], abs=1e-6)
        assert live["per_label"][name]["recall"] == pytest.approx(r[i], abs=1e-6)
    assert live["per_label"]["refund"]["support"] == 0
    assert live["coverage"] == 1.0


def test_abstentions_give_coverage_and_accuracy_on_answered():
    rows = ([{"label": "pos", "truth": "pos"}] * 6 + [{"label": "neg", "truth": "pos"}] * 2
            + [{"label": None, "truth": "neg"}] * 2)
    live = quality.live_figures(rows)
    assert live["coverage"] == pytest.approx(0.8)
    assert live["answered"] == 8
    assert live["accuracy"] == pytest.approx(6 / 8)


def test_no_feedback_gives_nulls():
    live = quality.live_figures([])
    assert live["accuracy"] is None and live["macro_f1"] is None and live["confusion"] is None


# -- a model's report, from the real prediction log (state/predlog.py) ---------------------------
class Logged:
    """Answers and truths written to the real PredictionLog as the service
    writes them (add, add_feedback), then flushed so its reads see them."""

    def __init__(self, plog) -> None:
        self.plog = plog

    def answer(self, model: str, version: int, text: str, label: str, scores: dict,
               rid: str, truth: str | None = None) -> None:
        self.plog.add([{"at": time.time(), "request_id": rid, "index": 0, "model": model,
                        "version": version, "text": text, "label": label, "scores": scores}])
        if truth is not None:
            self.plog.flush(30)  # feedback joins a logged prediction
            self.plog.add_feedback(rid, 0, truth, model=model, version=version, text=text,
                                   predicted=label).result(30)

    def done(self) -> None:
        self.plog.flush(30)


def _version(root: str, name: str, version: int, profile: dict | None) -> None:
    folder = os.path.join(root, name, str(version))
    os.makedirs(folder)
    open(os.path.join(folder, "model.keras"), "wb").close()
    with open(os.path.join(folder, "meta.json"), "w") as fh:
        json.dump({"labels": ["neg", "pos"], "metrics": {"accuracy": 0.85, "macro_f1": 0.84,
                                                         "measured_on": "validation"}}, fh)
    if profile is not None:
        with open(os.path.join(folder, prof.FILENAME), "w") as fh:
            json.dump(profile, fh)


@pytest.fixture
def quality_part(tmp_path):
    from state.predlog import PredictionLog
    from state.store import ModelStore

    rows = _demo()
    rng = random.Random(5)
    rng.shuffle(rows)
    train, live = rows[:3000], rows[3000:]
    # held-out scores: what a model right 85 % of the time, fairly sure, gives
    def scores(label):
        top = rng.uniform(0.55, 1.0)
        right = rng.random() < 0.85
        guess = label if right else ("neg" if label == "pos" else "pos")
        return guess, {guess: top, ("neg" if guess == "pos" else "pos"): 1 - top}
    held = [scores(r["label"]) for r in train[:600]]
    profile = prof.build([r["text"] for r in train], [r["label"] for r in train], ["neg", "pos"],
                         [[s["neg"], s["pos"]] for _, s in held], "validation")
    root = str(tmp_path / "models")
    _version(root, "rev", 1, None)        # an older version: no profile
    _version(root, "rev", 2, profile)
    plog = PredictionLog(str(tmp_path / "predictions.db"))
    from control.serving import ServingState
    part = quality.Quality(CFG, ModelStore(root), plog, ServingState(), None)
    yield part, Logged(plog), live, scores
    plog.close()


def test_report_per_version_with_and_without_profile(quality_part):
    part, log, live, scores = quality_part
    truths = {}
    for i, r in enumerate(live[:300]):
        label, sc = scores(r["label"])
        log.answer("rev", 2, r["text"], label, sc, f"r{i}",
                   truth=r["label"] if i < 40 else None)
        if i < 40:
            truths[f"r{i}"] = (label, r["label"])
    for i, r in enumerate(live[300:320]):
        label, sc = scores(r["label"])
        log.answer("rev", 1, r["text"], label, sc, f"o{i}")
    log.done()
    report = part.compute("rev")
    assert report["model"] == "rev"
    v2, v1 = report["versions"]
    assert (v2["version"], v2["predictions"], v2["feedback"]) == (2, 300, 40)
    want = sum(label == truth for label, truth in truths.values()) / len(truths)
    assert v2["live"]["accuracy"] == pytest.approx(want, abs=1e-6)
    assert v2["training"]["accuracy"] == 0.85
    d = v2["drift"]
    assert d["texts"] == 300 and d["alert"] is False, d
    assert abs(d["unknown_ngram_excess"]) < CFG.max_unknown_excess
    # the version without a profile: drift null, the rest as usual
    assert (v1["version"], v1["predictions"], v1["feedback"], v1["drift"]) == (1, 20, 0, None)
    assert v1["live"]["accuracy"] is None
    with pytest.raises(NotFound):
        part.compute("nosuch")


def test_foreign_text_raises_the_alert(quality_part):
    part, log, live, scores = quality_part
    english = ["Return True if the operand is a normal number; otherwise return False.",
               "Create a new socket using the given address family and socket type.",
               "Remove and return an arbitrary element from the set.",
               "Decode the bytes using the codec registered for encoding."]
    def foreign(start: int, n: int) -> dict:
        for i in range(start, start + n):
            label, sc = scores("pos")
            log.answer("rev", 2, f"{english[i % 4]} {i}", label, sc, f"e{i}")
        log.done()
        return part.compute("rev")["versions"][0]["drift"]
    # too few texts (100 < min_texts 200): the signal shows, the alert waits
    d = foreign(0, 100)
    assert d["texts"] == 100
    assert d["unknown_ngram_excess"] > 0.5 and d["alert"] is False
    # enough of them: the alert
    d = foreign(100, 200)
    assert d["texts"] == 300
    assert d["unknown_ngram_excess"] > 0.5 and "unknown_ngram_excess" in d["over"]
    assert d["alert"] is True


# -- through the real service ------------------------------------------------------------------
def test_live_figures_through_the_service(store_copy):
    """POST /predict, POST /feedback with known true labels, then GET /quality
    and /metrics give the figures computed here from the answers."""
    import re

    from tests.helpers import Service, request, wait_for

    s = Service(store_copy)
    try:
        code, body = s.mpost("/apply", {"name": "sent"})
        assert code == 200, body
        texts = ["很好", "非常好用", "喜欢", "很差", "太差了", "讨厌", "桌子", "今天下雨"] * 5
        truth = (["pos", "pos", "pos", "neg", "neg", "neg", "neg", "pos"] * 5)
        code, answer = s.predict({"texts": texts})
        assert code == 200, answer
        predicted = [p["label"] for p in answer["predictions"]]
        code, fb = request(s.port, "POST", "/feedback",
                           {"request_id": answer["request_id"], "labels": truth})
        assert code == 200 and fb["stored"] == len(texts), fb

        def report():
            code, body = s.mget("/models/sent/quality")
            assert code == 200, body
            v = body["versions"][0]
            return v["feedback"] == len(texts) and v
        v = wait_for(report, 30, "the feedback counted", interval=0.1)
        labels = sorted(set(truth) | set(predicted))
        assert v["version"] == 2 and v["predictions"] >= len(texts)
        assert v["live"]["accuracy"] == pytest.approx(accuracy_score(truth, predicted), abs=1e-6)
        assert v["live"]["macro_f1"] == pytest.approx(
            f1_score(truth, predicted, average="macro", labels=labels, zero_division=0), abs=1e-6)
        assert v["live"]["confusion"] == {
            "labels": labels, "rows": confusion_matrix(truth, predicted, labels=labels).tolist()}
        assert v["drift"] is None  # the tiny test models have no profile

        code, text = request(s.mport, "GET", "/metrics")
        text = text.decode() if isinstance(text, bytes) else text
        m = re.search(r'^textswap_live_accuracy\{model="sent",version="2"\} (\S+)$', text, re.M)
        assert m and float(m.group(1)) == pytest.approx(v["live"]["accuracy"], abs=1e-6)
        assert re.search(r'^textswap_feedback_total\{model="sent",version="2"\} 40\.0$', text,
                         re.M)
        # bad names and unknown models: 4xx with a JSON body
        assert s.mget("/models/nosuch/quality")[0] == 404
        code, body = s.mget("/models/..bad/quality")
        assert code == 400 and body["error"]["code"] == "invalid_name"
    finally:
        s.stop()
